"""The compression gain over a window of steps under error feedback.

With error feedback, what a window of steps sends adds up to the gradients of the window plus
the residual it started with, less the residual it ends with (``sent_t = x_t - e_t`` and
``x_t = g_t + e_{t-1}``)::

    S = sum_t sent_t = sum_t g_t + e_0 - e_W,        X = S + e_W = sum_t g_t + e_0

``X`` is everything the window had to send and ``S`` what it delivered; what a single step
holds back is delivered at later steps. The window gain is the squared cosine of the two,
``<S, X>^2 / (||S||^2 ||X||^2)`` (:func:`gravac.gain.gain_from_terms`), which for a window of
one step is the per-step gain of :mod:`gravac.gain` (``S = C(x)``, ``X = x``). The per-step
gain says little about what error feedback delivers over several steps; the window gain follows
the progress a CF makes far more closely (``docs/studies/2026-11-30-which-gain.md``).

``S`` is kept for a fixed sample of every compressed tensor's elements (blocks of
:data:`WINDOW_BLOCK` consecutive elements, one block in every :data:`WINDOW_STRIDE`, or more
thinly where the compressed layout holds more than :data:`SAMPLE_BUDGET` times that many:
:func:`budget_stride`), by the
tensor's stable layer id (:attr:`gravac.engine.Unit.layer_ids`), so that it survives bucket
rebuilds and checkpoints; ``e`` is the residual the step after the window starts from. The
window gain of every rank is summed term by term (as the per-step terms are) before it reaches
the controller.

The searches rank CFs by compression throughput, system throughput times the fraction of a dense
step's progress a step at the CF makes, as predicted from the CF's window gain
(:func:`predicted_progress`). The window gain's square root, the cosine of ``S`` and ``X`` (for
one step of a sparsifier ``||C(x)|| / ||x||``, the ratio of norms the GraVAC reference code's
gain is), predicts the progress of static CFs better, yet the searches that rank by it reached
the target no sooner, at higher CFs (fewer bytes on the CNNs, a worse LSTM perplexity), so the
gain itself stays the default (``docs/studies/2026-11-30-which-gain.md``,
``docs/studies/2026-12-01-three-seeds-cosine.md``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from gravac.gain import inner

__all__ = [
    "PROGRESS_MEASURES",
    "SAMPLE_BUDGET",
    "VIEW_TENSORS",
    "WINDOW_BLOCK",
    "WINDOW_STRIDE",
    "SampledSend",
    "Sampler",
    "WindowSums",
    "budget_stride",
    "predicted_progress",
    "rekeyed",
    "sample",
    "sample_index",
    "sample_size",
    "window_terms",
]

V = TypeVar("V")
#: one block of elements in every WINDOW_STRIDE is sampled: the sums cost 1/16 of a gradient's
#: memory, and energies over a few thousand sampled elements estimate those over all of them
#: to a few percent (the gain is a ratio of such energies)
WINDOW_STRIDE = 16
#: elements a sampled sum over the whole layout may hold: a layout of more than WINDOW_STRIDE
#: times as many compressed elements (64M, a gradient of 256 MiB) is sampled at a power-of-two
#: multiple of the stride (:func:`budget_stride`), so that the search's memory stops growing
#: with the model (at 1/16 it held 0.36 of a gradient in all); samples of this size estimate a
#: window gain at least as closely as the smaller models' samples do
#: (``docs/studies/2026-12-06-sample-budget.md``), and smaller layouts sample as before
SAMPLE_BUDGET = 2**22
#: elements in a sampled block: 16 float32 fill a 64-byte cache line, so sampling reads 1/16 of
#: the tensor's memory (every 16th element alone touches every line: a pass over all of it, 1 ms
#: a step on the VGG-style CNN's 21 MB of gradient, three times over)
WINDOW_BLOCK = 16
#: a unit of at most this many tensors is sampled tensor by tensor through views, which hold no
#: positions (a unit's positions cost as much memory as its sample, int32: 1/16 of its gradient
#: at the window's stride); one of more tensors in one ``index_select`` over cached positions,
#: so that a bucket of many small tensors pays one call rather than two a tensor
VIEW_TENSORS = 4
#: version of the sampling in a saved :class:`WindowSums` (sums sampled otherwise are dropped)
_SAMPLING = 2
#: a unit's sampled send (:class:`SampledSend`) is held as its entries other than +0.0 and
#: their positions where at most this fraction of its entries are such (a sparsifier's send:
#: 1/CF of them): 8 bytes an entry against 4 whole, so at most half the memory
_SPARSE_FRACTION = 0.25
#: how a window gain predicts the progress per step (:func:`predicted_progress`): the gain
#: itself (the default, as the GraVAC paper's compression throughput multiplies by it) or its
#: square root (see the module docstring)
PROGRESS_MEASURES = ("energy", "cosine")


def predicted_progress(gain: float, measure: str) -> float:
    """The fraction of a dense step's progress that a step at a CF makes, predicted from the
    CF's window gain ``g``: ``sqrt(max(g, 0))`` for ``"cosine"``, ``g`` for ``"energy"``
    (:data:`PROGRESS_MEASURES`; see the module docstring).

    Raises:
        ValueError: ``measure`` is not one of :data:`PROGRESS_MEASURES`.
    """
    if measure == "cosine":
        return math.sqrt(max(gain, 0.0))
    if measure == "energy":
        return gain
    raise ValueError(f"measure must be one of {PROGRESS_MEASURES}, got {measure!r}")


def budget_stride(total: int, stride: int, budget: int = SAMPLE_BUDGET) -> int:
    """The stride a layout of ``total`` compressed elements is sampled at: ``stride``, or its
    least power-of-two multiple ``stride * 2^j`` with ``total <= budget * stride * 2^j`` (about
    ``budget`` elements sampled). Every rank binds the same layout, so every rank samples
    alike."""
    factor = 1
    while total > budget * stride * factor:
        factor *= 2
    return stride * factor


def sample_size(numel: int, stride: int = WINDOW_STRIDE) -> int:
    """How many of a tensor's ``numel`` elements :func:`sample` takes."""
    full, rest = divmod(numel, WINDOW_BLOCK * stride)
    return full * WINDOW_BLOCK + min(rest, WINDOW_BLOCK)


def sample(t: Tensor, stride: int = WINDOW_STRIDE) -> Tensor:
    """The sampled elements of ``t``, flat, in order (a new tensor): the first
    :data:`WINDOW_BLOCK` of every ``WINDOW_BLOCK * stride`` elements."""
    flat = t.reshape(-1)
    out = torch.empty(sample_size(flat.numel(), stride), dtype=flat.dtype, device=flat.device)
    _sample_into(flat, out, stride)
    return out


def _sample_into(flat: Tensor, out: Tensor, stride: int) -> None:
    """Copy :func:`sample` of the flat tensor ``flat`` into ``out``, through views: no
    positions are made."""
    span = WINDOW_BLOCK * stride
    full = flat.numel() // span
    out[: full * WINDOW_BLOCK].view(full, WINDOW_BLOCK).copy_(
        flat[: full * span].view(full, span)[:, :WINDOW_BLOCK]
    )
    out[full * WINDOW_BLOCK :].copy_(flat[full * span : full * span + WINDOW_BLOCK])


def sample_index(numels: Sequence[int], stride: int, device: torch.device) -> Tensor:
    """The positions, in a flat unit of tensors of ``numels`` elements, of every tensor's
    :func:`sample` at ``stride``, in order (int32 where they fit): one ``index_select`` samples
    the whole unit."""
    span = WINDOW_BLOCK * stride
    parts, offset = [], 0
    for n in numels:
        full, rest = divmod(n, span)
        starts = torch.arange(full, dtype=torch.int64) * span + offset
        parts.append((starts[:, None] + torch.arange(WINDOW_BLOCK)).reshape(-1))
        tail = offset + full * span
        parts.append(torch.arange(tail, tail + min(rest, WINDOW_BLOCK)))
        offset += n
    wide = sum(numels) > torch.iinfo(torch.int32).max
    return torch.cat(parts).to(device, torch.int64 if wide else torch.int32)


class Sampler:
    """Each tensor's :func:`sample` at ``stride`` of a flat unit of tensors, end to end in a new
    flat tensor: a unit of at most :data:`VIEW_TENSORS` tensors through views, one of more in one
    ``index_select`` over its positions (:func:`sample_index`), cached by layout until a layout
    goes unused between two :meth:`prune` calls."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self._index: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}
        self._used: set[tuple[tuple[int, ...], torch.device]] = set()  # layouts since prune

    def __call__(self, flat: Tensor, numels: Sequence[int]) -> Tensor:
        flat = flat.reshape(-1)
        if len(numels) > VIEW_TENSORS:
            key = (tuple(numels), flat.device)
            self._used.add(key)
            if key not in self._index:
                self._index[key] = sample_index(numels, self.stride, flat.device)
            return flat.index_select(0, self._index[key])
        sizes = [sample_size(n, self.stride) for n in numels]
        out = torch.empty(sum(sizes), dtype=flat.dtype, device=flat.device)
        at = 0  # a padded unit's flat tensor may run past its tensors
        for n, into in zip(numels, out.split(sizes), strict=True):
            _sample_into(flat[at : at + n], into, self.stride)
            at += n
        return out

    def nbytes(self) -> int:
        """Bytes held by the cached positions."""
        return sum(t.numel() * t.element_size() for t in self._index.values())

    def prune(self) -> None:
        """Drop the positions of the layouts not sampled since the last call (a bucket
        rebuild's old layouts would otherwise stay cached for the rest of the run)."""
        self._index = {k: v for k, v in self._index.items() if k in self._used}
        self._used = set()

    def reset(self) -> None:
        """Drop every cached position (the layout changed)."""
        self._index, self._used = {}, set()


def window_terms(sent: Tensor, residual: Tensor) -> Tensor:
    """``[<S, X>, ||S||^2, ||X||^2]`` for ``X = S + e``, in float64: the terms of
    :func:`gravac.gain.gain_from_terms` for the window that sent ``S`` and ends holding ``e``."""
    return _terms(sent, sent + residual)


def _terms(sent: Tensor, total: Tensor) -> Tensor:
    """:func:`window_terms` of ``S = sent`` and ``X = total``."""
    return torch.stack([inner(sent, total), inner(sent, sent), inner(total, total)])


def rekeyed(table: Mapping[int, V], layers: Mapping[int, int]) -> dict[int, V]:
    """``table``'s entries by layer id moved to their new ids (``layers``: old -> new); those
    of layers not in ``layers`` dropped."""
    return {layers[k]: v for k, v in table.items() if k in layers}


def _split(flat: Tensor, numels: Sequence[int]) -> list[Tensor]:
    return list(flat.reshape(-1).split(list(numels)))


@dataclass(frozen=True)
class SampledSend:
    """What a unit sent at one step, sampled: ``x - e`` over its tensors' samples, flat, in
    float32 (:meth:`WindowSums.sampled_send`), held from the unit's launch to the step's
    commit. Whole (``positions`` is ``None``), or, where few of its entries are other than
    +0.0 (a sparsifier's send), those entries (``values``) and their positions (int32), bit
    for bit the same tensor once :meth:`dense`."""

    values: Tensor
    positions: Tensor | None
    size: int

    def dense(self) -> Tensor:
        """The send, whole."""
        if self.positions is None:
            return self.values
        return self.values.new_zeros(self.size).index_put_((self.positions,), self.values)


class WindowSums:
    """What each compressed tensor sent over the current window, sampled (see the module
    docstring), by layer id; and over the windows before it that the gain's horizon spans
    (:meth:`clear`), so that a gain judged at a window's end may cover several windows."""

    def __init__(self) -> None:
        self.sent: dict[int, Tensor] = {}  # sampled sum of what was sent, by layer id
        self.earlier: list[dict[int, Tensor]] = []  # the windows before it, oldest first
        self.stride = WINDOW_STRIDE  # the layout's (:meth:`fit`)
        self._sampled = Sampler(self.stride)

    def fit(self, total: int) -> None:
        """Sample a layout of ``total`` compressed elements at :func:`budget_stride`; the sums
        sampled at another stride are dropped (the window restarts)."""
        stride = budget_stride(total, WINDOW_STRIDE, SAMPLE_BUDGET)
        if stride != self.stride:
            self.stride, self._sampled = stride, Sampler(stride)
            self.sent, self.earlier = {}, []

    def terms(
        self,
        layers: Sequence[int],
        numels: Sequence[int],
        residual: Tensor | None,
        totals: list[Tensor] | None = None,
    ) -> Tensor:
        """The local window terms of one unit at the step after its window, whose ``residual``
        (flat; ``None``: zero) the window ended with; ``S`` spans the earlier windows kept too.
        A tensor with nothing sent yet contributes its residual alone. With ``totals``, each
        tensor's sampled ``X = S + e`` (everything the window had to send) is appended to it."""
        parts = [None] * len(numels) if residual is None else _split(residual, numels)
        total = torch.zeros(3, dtype=torch.float64)
        for layer, n, e in zip(layers, numels, parts, strict=True):
            held = [sums[layer] for sums in (*self.earlier, self.sent) if layer in sums]
            x = torch.zeros(sample_size(n, self.stride)) if e is None else sample(e, self.stride)
            x = x.float()
            s = sum(held[1:], held[0]) if held else torch.zeros_like(x)
            x = x.to(s.device).add_(s)  # X = S + e, in the sample's own copy
            total = total.to(s.device) + _terms(s, x)
            if totals is not None:
                totals.append(x)
        return total

    def taken(self, x: Tensor, numels: Sequence[int]) -> Tensor:
        """The sampled elements of a unit's error-fed gradient ``x``, its tensors' end to end
        (a copy: the residual update may consume ``x``)."""
        return self._sampled(x, numels)

    def _send(self, taken: Tensor, residual: Tensor | None, numels: Sequence[int]) -> Tensor:
        """``x - e`` over the sample, in float32 (``e``: zero where ``residual`` is ``None``),
        in ``taken`` itself where it is float32 (it is this object's copy: :meth:`taken`)."""
        send = taken.float()
        return send if residual is None else send.sub_(self._sampled(residual, numels))

    def sampled_send(
        self, taken: Tensor, residual: Tensor | None, numels: Sequence[int]
    ) -> SampledSend:
        """What a unit sends, sampled, once its new residual is known: for a front end that
        settles the residual at launch (:meth:`gravac.memory.Memory.settle`), so that only this
        is held until the step commits (:meth:`add_send`), not ``taken``; for a sparsifier a
        fraction of its size. Whole on a CUDA device (counting the entries would wait for it)."""
        send = self._send(taken, residual, numels)
        if send.device.type != "cpu":
            return SampledSend(send, None, send.numel())
        kept = send.view(torch.int32) != 0  # +0.0 is the one float32 with no bit set
        if int(torch.count_nonzero(kept)) > _SPARSE_FRACTION * send.numel():
            return SampledSend(send, None, send.numel())
        positions = kept.nonzero().view(-1)
        values = send.index_select(0, positions)
        narrow = send.numel() <= torch.iinfo(torch.int32).max
        return SampledSend(values, positions.to(torch.int32) if narrow else positions, send.numel())

    def add(
        self,
        layers: Sequence[int],
        numels: Sequence[int],
        taken: Tensor,
        residual: Tensor | None,
    ) -> None:
        """Add what a committed step sent, ``x - e`` (``taken`` from :meth:`taken`, ``e`` the
        unit's new residual; ``None``: zero, after a dense send)."""
        self._accumulate(layers, numels, self._send(taken, residual, numels))

    def add_send(self, layers: Sequence[int], numels: Sequence[int], send: SampledSend) -> None:
        """Add what a committed step sent, from :meth:`sampled_send`: the same sums as
        :meth:`add`."""
        self._accumulate(layers, numels, send.dense())

    def _accumulate(self, layers: Sequence[int], numels: Sequence[int], send: Tensor) -> None:
        """Add each tensor's part of a unit's sampled ``send`` to its sum."""
        parts = send.split([sample_size(n, self.stride) for n in numels])
        for layer, part in zip(layers, parts, strict=True):
            old = self.sent.get(layer)
            self.sent[layer] = part if old is None else old.add_(part)

    def relayer(self, layers: Mapping[int, int]) -> None:
        """The layout changed: each sum kept moves to its tensor's new layer id (``layers``:
        old id -> new id); a tensor no longer compressed has its sums dropped."""
        self.sent = rekeyed(self.sent, layers)
        self.earlier = [rekeyed(sums, layers) for sums in self.earlier]
        self._sampled.reset()

    def forget(self, layers: Collection[int]) -> None:
        """Drop the sums of ``layers``, tensors that no longer exist (a chunk of a unit that
        DDP's bucket rebuild retired, :meth:`gravac.engine.Engine.forget`)."""
        for sums in (self.sent, *self.earlier):
            for layer in layers:
                sums.pop(layer, None)

    def rescale(self, factor: float) -> None:
        """Multiply every sum kept by ``factor`` (gradients whose unit changed:
        :meth:`gravac.memory.Memory.rescale`)."""
        for sums in (self.sent, *self.earlier):
            for t in sums.values():
                t.mul_(factor)

    def clear(self, keep: int = 0) -> None:
        """Start a new window; the sums of the last ``keep`` windows (the one that ended
        included) stay in the terms of the next window's end."""
        self.earlier = [*self.earlier, self.sent][-keep:] if keep else []
        self.sent = {}
        self._sampled.prune()

    def state_dict(self) -> dict[str, Any]:
        def rows(sums: dict[int, Tensor]) -> list[tuple[int, Tensor]]:
            return [(k, v.clone()) for k, v in sorted(sums.items())]

        return {
            "sampling": _SAMPLING,
            "stride": self.stride,
            "sent": rows(self.sent),
            "earlier": [rows(sums) for sums in self.earlier],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sums and the stride they were sampled at (an older gravac's: the base
        stride); sums sampled otherwise (an older gravac's way) are dropped, so the window
        restarts."""
        same = state.get("sampling") == _SAMPLING
        self.stride = int(state.get("stride", WINDOW_STRIDE))
        self._sampled = Sampler(self.stride)

        def sums(rows: list[Any]) -> dict[int, Tensor]:
            return {int(k): torch.as_tensor(v).float().clone() for k, v in rows if same}

        self.sent = sums(state["sent"])
        self.earlier = [sums(rows) for rows in state.get("earlier", [])] if same else []
