"""Window gains of CFs that are not sent: error feedback replayed on a sample of the gradient.

The window gain (:mod:`gravac.window`) of a CF is measured by sending that CF for a window, so a
search that judges candidates by it pays for each with a window of steps at that CF. A
sparsifier's error feedback can be replayed on a sample instead: for each CF ``c`` of a set, a
*shadow* residual ``r_c`` of sampled elements (blocks of 16, one in :data:`SHADOW_STRIDE`:
:func:`gravac.window.sample`) follows the sampled gradient ``g`` as the real residual would
follow it if ``c`` were sent::

    x_c = g + r_c;    kept = the compressor's choice at c among x_c's entries
                      (Compressor.shadow_kept);
    s_c = x_c at kept, 0 elsewhere;    r_c <- x_c - s_c;    S_c += s_c

and the window gain of ``c`` is the squared cosine of ``S_c`` and ``X_c = S_c + r_c``, as for the
CF sent (``X_c`` is the window's gradients plus the residual it started with, exactly: the
shadow sends entries of ``x_c`` and keeps the rest). The gradient ``g`` is the real one, so
every CF of the set is judged on the same steps, at the cost of one selection over the sample
per CF and step, and two sampled buffers per CF. What the shadow does not see
is the trajectory the model would have taken at ``c``; the CF actually sent is in the set as
well, so its shadow gain can be compared with its real window gain (``docs/CONTROLLER.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gravac.window import sample, sample_size, window_terms

__all__ = ["SHADOW_STRIDE", "ShadowSums", "shadow_gradient", "shadow_round"]

#: one block of 16 elements in every SHADOW_STRIDE is replayed: four times sparser than the
#: window's sample, so that a ladder of 8 CFs (the geometric policy's) costs 8 selections over
#: 1/64 of the gradient a step, and keeps 2 x 8 / 64 = 1/4 of the gradient's size; a CF of
#: 1000 still keeps 82 elements of the VGG-style CNN's 5.2M-element layer
SHADOW_STRIDE = 64
#: version of the state saved by :meth:`ShadowSums.state_dict` (another is dropped: the shadows
#: start again from zero residuals)
_VERSION = 1

Select = Callable[[Tensor, float], Tensor]


def shadow_gradient(x: Tensor, residual: Tensor | None, numels: Sequence[int]) -> list[Tensor]:
    """The replayed sample of each tensor's gradient ``g = x - e`` (float32), from a unit's
    flat error-fed gradient ``x`` and the residual ``e`` that was added to it (``None``: 0)."""
    xs = x.reshape(-1).split(list(numels))
    if residual is None:
        return [sample(t, SHADOW_STRIDE).float() for t in xs]
    es = residual.reshape(-1).split(list(numels))
    return [
        (sample(t, SHADOW_STRIDE) - sample(e, SHADOW_STRIDE)).float()
        for t, e in zip(xs, es, strict=True)
    ]


def shadow_round(
    gradient: Tensor, residual: Tensor, cf: float, select: Select
) -> tuple[Tensor, Tensor]:
    """One step of error feedback at ``cf`` on a sample: ``(sent, new residual)``.

    ``sent = x`` at ``select(x, cf)`` and 0 elsewhere, ``residual = x - sent`` (so the two add up
    to ``x = gradient + residual`` exactly), both new tensors.
    """
    x = gradient + residual
    kept = select(x, cf)
    sent = torch.zeros_like(x)
    sent.index_copy_(0, kept, x.index_select(0, kept))
    return sent, x.index_fill_(0, kept, 0)


class ShadowSums:
    """Per CF and tensor (by layer id, as :class:`gravac.window.WindowSums`): the shadow residual
    and the sum of what the shadow sent over the current window."""

    def __init__(self) -> None:
        self.residual: dict[tuple[float, int], Tensor] = {}  # (cf, layer) -> sampled r_c
        self.sent: dict[tuple[float, int], Tensor] = {}  # (cf, layer) -> sampled S_c

    def terms(self, cfs: Sequence[float], layers: Sequence[int], numels: Sequence[int]) -> Tensor:
        """``[<S, X>, ||S||^2, ||X||^2]`` of every CF in ``cfs``, in that order, for one unit's
        tensors (float64, ``3 len(cfs)`` values; a tensor with no shadow yet adds zeros)."""
        out = torch.zeros(3 * len(cfs), dtype=torch.float64)
        for i, cf in enumerate(cfs):
            for layer, n in zip(layers, numels, strict=True):
                s, e = self.sent.get((cf, layer)), self.residual.get((cf, layer))
                if s is None and e is None:
                    continue
                zero = torch.zeros(sample_size(n, SHADOW_STRIDE))
                s = zero if s is None else s
                e = zero.to(s.device) if e is None else e
                out[3 * i : 3 * i + 3] += window_terms(s, e).cpu()
        return out

    def step(
        self,
        cfs: Sequence[float],
        layers: Sequence[int],
        gradient: Sequence[Tensor],
        select: Select,
        *,
        accumulate: bool,
    ) -> None:
        """Replay one committed step of one unit at every CF in ``cfs``: ``gradient`` is the
        sample of each of its tensors' gradients (:func:`shadow_gradient`). The
        selection runs over the unit's tensors together, as the compressor's does. What was
        sent is added to the window's sums if ``accumulate`` (not at a step that closes a
        window: :meth:`gravac.engine.Engine._sums`)."""
        keep = set(cfs)
        for store in (self.residual, self.sent):
            for key in [k for k in store if k[0] not in keep]:
                del store[key]  # CFs the controller no longer asks about
        if not gradient:
            return
        g_parts = [t.reshape(-1) for t in gradient]
        g, sizes = torch.cat(g_parts), [t.numel() for t in g_parts]
        for cf in cfs:
            pairs = zip(layers, g_parts, strict=True)
            r = torch.cat([self._residual(cf, layer, t) for layer, t in pairs])
            sent, r = shadow_round(g, r, cf, select)
            for layer, e, s in zip(layers, r.split(sizes), sent.split(sizes), strict=True):
                self.residual[(cf, layer)] = e
                if accumulate:
                    old = self.sent.get((cf, layer))
                    self.sent[(cf, layer)] = s if old is None else old.add_(s)

    def _residual(self, cf: float, layer: int, like: Tensor) -> Tensor:
        """The shadow residual of ``layer`` at ``cf`` (zeros shaped as ``like`` before one)."""
        r = self.residual.get((cf, layer))
        return torch.zeros_like(like) if r is None else r

    def clear(self) -> None:
        """Start a new window: the sums restart, the shadow residuals carry on."""
        self.sent.clear()

    def state_dict(self) -> dict[str, Any]:
        def rows(store: dict[tuple[float, int], Tensor]) -> list[tuple[float, int, Tensor]]:
            return [(cf, layer, t.clone()) for (cf, layer), t in sorted(store.items())]

        return {"version": _VERSION, "residual": rows(self.residual), "sent": rows(self.sent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the shadows; a state of another version (or none) starts them afresh."""
        same = state.get("version") == _VERSION

        def table(key: str) -> dict[tuple[float, int], Tensor]:
            rows = state.get(key, []) if same else []
            return {(float(cf), int(layer)): torch.as_tensor(t).clone() for cf, layer, t in rows}

        self.residual, self.sent = table("residual"), table("sent")
