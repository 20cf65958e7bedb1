"""Window gains of CFs that are not sent: error feedback replayed on a sample of the gradient.

The window gain (:mod:`gravac.control.window`) of a CF is measured by sending that CF for a window,
so a search that judges candidates by it pays for each with a window of steps at that CF. A
sparsifier's error feedback can be replayed on a sample instead: for each CF ``c`` of a set, a
*shadow* residual ``r_c`` of sampled elements (blocks of 16, one in :data:`SHADOW_STRIDE`, more
thinly above :data:`SHADOW_BUDGET` samples:
:func:`gravac.control.window.sample`) follows the sampled gradient ``g`` as the real residual would
follow it if ``c`` were sent::

    x_c = g + r_c;    kept = the compressor's choice at c among x_c's entries
                      (Compressor.shadow_kept);
    s_c = x_c at kept, 0 elsewhere;    r_c <- x_c - s_c;    S_c += s_c

and the window gain of ``c`` is the squared cosine of ``S_c`` and ``X_c = S_c + r_c``, as for the
CF sent (``X_c`` is the window's gradients plus the residual it started with, exactly: the
shadow sends entries of ``x_c`` and keeps the rest). The gradient ``g`` is the real one, so
every CF of the set is judged on the same steps, at the cost of one selection over the sample
per CF and step, two sampled buffers per CF, and the sample's indices (int32, cached per
layout: 1/64 of the gradient's memory). What the shadow does not see
is the trajectory the model would have taken at ``c``; the CF actually sent is in the set as
well, so its shadow gain can be compared with its real window gain
(``docs/studies/2026-12-01-search-by-shadow.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gravac.control.window import Sampler, budget_stride, sample_size, window_terms

__all__ = [
    "SHADOW_BUDGET",
    "SHADOW_STRIDE",
    "Replayed",
    "ShadowSums",
    "shadow_keep",
    "shadow_send",
]

#: one block of 16 elements in every SHADOW_STRIDE is replayed: four times sparser than the
#: window's sample, so that a ladder of 8 CFs (the geometric policy's) costs 8 selections over
#: 1/64 of the gradient a step, and keeps 2 x 8 / 64 = 1/4 of the gradient's size; a CF of
#: 1000 still keeps 82 elements of the VGG-style CNN's 5.2M-element layer
SHADOW_STRIDE = 64
#: elements each shadow's sampled residual or sum over the whole layout may hold: as the
#: window's :data:`gravac.control.window.SAMPLE_BUDGET` at its four times sparser stride, so
#: that both grow their strides from the same layout on (64M compressed elements)
SHADOW_BUDGET = 2**20
#: version of the state saved by :meth:`ShadowSums.state_dict`: 2 keeps one flat tensor per CF
#: and dtype (its layers and their sizes beside it), 1 kept one tensor per CF and layer, a cost
#: that grew with the layers (110,000 tensors for a ladder of 5 CFs over 10,000 parameters); any
#: other is dropped: the shadows start again from zero residuals
_VERSION = 2
#: the versions :meth:`ShadowSums.load_state_dict` reads
_READS = (1, 2)

Select = Callable[[Tensor, float], Tensor]
#: a row of the saved state: a CF, its layers, their sizes and their pieces end to end
_Row = tuple[float, list[int], list[int], Tensor]
#: a unit: the layer ids of its tensors, in order
Layers = tuple[int, ...]


@dataclass(frozen=True)
class Replayed:
    """One unit's step replayed at every CF (:meth:`ShadowSums.replay`), not yet applied: the
    sampled gradient, whether what was sent adds to the window's sums, and per CF the
    indices sent and their values (:func:`shadow_send`)."""

    unit: Layers
    gradient: Tensor
    accumulate: bool
    rounds: tuple[tuple[float, Tensor, Tensor], ...]


def shadow_send(
    gradient: Tensor, residual: Tensor | None, cf: float, select: Select
) -> tuple[Tensor, Tensor]:
    """What one step of error feedback at ``cf`` sends of a sample: ``(kept, values)``.

    ``x = gradient + residual`` (``None``: 0); ``kept = select(x, cf)`` are the indices sent and
    ``values`` their entries of ``x``. Neither input is changed (:func:`shadow_keep` then
    makes the new residual).
    """
    x = gradient if residual is None else gradient + residual
    kept = select(x, cf)
    return kept, x.index_select(0, kept)


def shadow_keep(gradient: Tensor, residual: Tensor | None, kept: Tensor) -> Tensor:
    """The new residual of the step :func:`shadow_send` sent ``kept`` of: ``x = gradient +
    residual`` with those entries zeroed, in ``residual``'s storage (a new tensor where it is
    ``None``), so that what is sent and what is kept add up to ``x`` exactly (the sum is the
    one :func:`shadow_send` selected on: IEEE addition commutes)."""
    x = gradient.clone() if residual is None else residual.add_(gradient)
    return x.index_fill_(0, kept, 0)


class ShadowSums:
    """Per CF and unit (a bucket's tensors, by their layer ids, as
    :class:`gravac.control.window.WindowSums` keeps them): the shadow residual and the sum of what
    the shadow sent over the current window, flat over the unit's sampled elements.

    A unit's samples are gathered in one indexed read (the indices cached by layout), and each
    CF is replayed over the whole unit at once, as the compressor selects over it. Per tensor
    (by layer id) they are only split where the layout changes and in the checkpoint, so that
    they survive bucket rebuilds and resumes: a unit whose key is new is joined from the pieces
    of its tensors (zeros for a tensor without one).
    """

    def __init__(self) -> None:
        self.residual: dict[tuple[float, Layers], Tensor] = {}  # (cf, unit) -> sampled r_c
        self.sent: dict[tuple[float, Layers], Tensor] = {}  # (cf, unit) -> sampled S_c
        # per tensor, not yet joined into a unit (after a resume or a layout change)
        self._loose: dict[str, dict[tuple[float, int], Tensor]] = {"residual": {}, "sent": {}}
        # the sums of the windows before this one that the gain's horizon spans, oldest first,
        # per tensor: (cf, layer) -> sampled S_c of that window
        self.earlier: list[dict[tuple[float, int], Tensor]] = []
        self._sizes: dict[Layers, list[int]] = {}  # a unit's tensors' sample sizes
        self.stride = SHADOW_STRIDE  # the layout's (:meth:`fit`)
        self._sampled = Sampler(self.stride)

    def fit(self, total: int) -> None:
        """Replay on a layout of ``total`` compressed elements at
        :func:`gravac.control.window.budget_stride` (:data:`SHADOW_BUDGET`); the shadows
        sampled at another stride are dropped (they start afresh)."""
        stride = budget_stride(total, SHADOW_STRIDE, SHADOW_BUDGET)
        if stride != self.stride:
            self.stride, self._sampled = stride, Sampler(stride)
            self.residual, self.sent, self.earlier, self._sizes = {}, {}, [], {}
            self._loose = {"residual": {}, "sent": {}}

    def gradient(self, x: Tensor, residual: Tensor | None, numels: Sequence[int]) -> Tensor:
        """The replayed sample of a unit's gradient ``g = x - e`` (flat, float32), from its
        flat error-fed gradient ``x`` and the residual ``e`` that was added to it (``None``:
        0): each tensor's :func:`gravac.control.window.sample` at the layout's stride
        (:data:`SHADOW_STRIDE` below :data:`SHADOW_BUDGET`), in order."""
        g = self._sampled(x, numels).float()
        if residual is not None:
            g.sub_(self._sampled(residual, numels))
        return g

    def terms(self, cfs: Sequence[float], layers: Sequence[int], numels: Sequence[int]) -> Tensor:
        """``[<S, X>, ||S||^2, ||X||^2]`` of every CF in ``cfs``, in that order, for one unit's
        tensors (float64, ``3 len(cfs)`` values; a unit with no shadow yet adds zeros)."""
        out = torch.zeros(3 * len(cfs), dtype=torch.float64)
        unit = self._unit(layers, numels)
        for i, cf in enumerate(cfs):
            s, e = self._get("sent", cf, unit), self._get("residual", cf, unit)
            before = self._before(cf, unit)
            if before is not None:
                s = before if s is None else s + before
            if e is None:
                if s is None:
                    continue
                e = torch.zeros_like(s)
            elif s is None:
                s = torch.zeros_like(e)
            out[3 * i : 3 * i + 3] += window_terms(s, e).cpu()
        return out

    def replay(
        self,
        cfs: Sequence[float],
        layers: Sequence[int],
        numels: Sequence[int],
        gradient: Tensor,
        select: Select,
        *,
        accumulate: bool,
    ) -> Replayed:
        """One step of one unit replayed at every CF in ``cfs``, not yet applied: what each
        shadow sends (:func:`shadow_send`; the selections, the replay's cost). ``gradient`` is
        the sample of the unit's gradient (:meth:`gradient`); what was sent is to be added to
        the window's sums if ``accumulate`` (not at a step that closes a window:
        :meth:`gravac.engine.Engine._sums`). The shadows' values are left as they were, so that
        a step replayed while its communication is in flight can still be skipped, and no
        second copy of them is held meanwhile."""
        unit = self._unit(layers, numels)
        rounds = []
        for cf in cfs:
            kept, values = shadow_send(gradient, self._get("residual", cf, unit), cf, select)
            rounds.append((cf, kept, values))
        return Replayed(unit, gradient, accumulate, tuple(rounds))

    def apply(self, replayed: Replayed) -> None:
        """Commit a unit's :meth:`replay`: each shadow residual takes the step
        (:func:`shadow_keep`, in place) and, where it accumulates, the window's sum what was
        sent; the CFs it did not replay, which the controller no longer asks about, are
        dropped from every store."""
        keep = {cf for cf, _, _ in replayed.rounds}
        stores: list[dict[Any, Tensor]] = [
            self.residual,
            self.sent,
            *self._loose.values(),
            *self.earlier,
        ]
        for store in stores:
            for key in [k for k in store if k[0] not in keep]:
                del store[key]
        unit, g = replayed.unit, replayed.gradient
        for cf, kept, values in replayed.rounds:
            self.residual[(cf, unit)] = shadow_keep(g, self._get("residual", cf, unit), kept)
            if replayed.accumulate:
                total = self._get("sent", cf, unit)
                if total is None:
                    total = self.sent[(cf, unit)] = torch.zeros_like(g)
                total.index_add_(0, kept, values)

    def _before(self, cf: float, unit: Layers) -> Tensor | None:
        """What the shadow at ``cf`` sent over the earlier windows of the horizon, flat over
        ``unit``'s samples (zeros for a tensor without one); ``None`` if nothing."""
        total = None
        for sums in self.earlier:
            joined = self._join(unit, [sums.get((cf, layer)) for layer in unit])
            if joined is not None:
                total = joined if total is None else total + joined
        return total

    def _join(self, unit: Layers, pieces: Sequence[Tensor | None]) -> Tensor | None:
        """``unit``'s tensors' pieces, in order, as one flat tensor (zeros for a tensor
        without one); ``None`` if no tensor has one."""
        if all(p is None for p in pieces):
            return None
        like = next(p for p in pieces if p is not None)
        sizes = self._sizes[unit]
        return torch.cat(
            [like.new_zeros(n) if p is None else p for p, n in zip(pieces, sizes, strict=True)]
        )

    def _unit(self, layers: Sequence[int], numels: Sequence[int]) -> Layers:
        """The key of the unit of these tensors, its sample sizes recorded."""
        unit = tuple(layers)
        if unit not in self._sizes:
            self._sizes[unit] = [sample_size(n, self.stride) for n in numels]
        return unit

    def _get(self, name: str, cf: float, unit: Layers) -> Tensor | None:
        """The ``name`` store's tensor of ``unit`` at ``cf``; for a unit new to it, joined
        from its tensors' pieces (the other units of ``cf`` that share a tensor with it are
        split into pieces first); ``None`` if no tensor of the unit has one."""
        store: dict[tuple[float, Layers], Tensor] = getattr(self, name)
        found = store.get((cf, unit))
        if found is not None:
            return found
        loose = self._loose[name]
        for key in [k for k in store if k[0] == cf and set(k[1]) & set(unit)]:
            loose.update(self._pieces(cf, key[1], store.pop(key)))
        joined = self._join(unit, [loose.pop((cf, layer), None) for layer in unit])
        if joined is not None:
            store[(cf, unit)] = joined
        return joined

    def piece(self, name: str, cf: float, layer: int) -> Tensor | None:
        """Tensor ``layer``'s part of the ``name`` store (``"residual"`` or ``"sent"``) at
        ``cf``, wherever it is kept; ``None`` if it has none."""
        for (c, unit), t in getattr(self, name).items():
            if c == cf and layer in unit:
                return self._pieces(cf, unit, t)[(cf, layer)]
        return self._loose[name].get((cf, layer))

    def _by_tensor(self, name: str) -> dict[tuple[float, int], Tensor]:
        """The ``name`` store (``"residual"`` or ``"sent"``) by (cf, layer): its units split
        into their tensors' pieces, with the loose pieces."""
        out = dict(self._loose[name])
        for (cf, unit), t in getattr(self, name).items():
            out.update(self._pieces(cf, unit, t))
        return out

    def _pieces(self, cf: float, unit: Layers, t: Tensor) -> dict[tuple[float, int], Tensor]:
        """``t``, a flat tensor of ``unit`` at ``cf``, as its tensors' parts by (cf, layer)."""
        keys = [(cf, layer) for layer in unit]
        return dict(zip(keys, t.split(self._sizes[unit]), strict=True))

    def nbytes(self) -> int:
        """Bytes held: the shadow residuals and sums, and the cached sample indices."""
        held = [*self.residual.values(), *self.sent.values()]
        held += [t for loose in (*self._loose.values(), *self.earlier) for t in loose.values()]
        return sum(t.numel() * t.element_size() for t in held) + self._sampled.nbytes()

    def relayer(self, layers: Mapping[int, int]) -> None:
        """The layout changed: every shadow moves to its tensor's new layer id (``layers``: old
        id -> new id), held by layer until its new unit joins it; a tensor no longer
        compressed has its shadows dropped."""

        def moved(pieces: dict[tuple[float, int], Tensor]) -> dict[tuple[float, int], Tensor]:
            return {(cf, layers[k]): t for (cf, k), t in pieces.items() if k in layers}

        self._loose = {name: moved(self._by_tensor(name)) for name in ("residual", "sent")}
        self.earlier = [moved(sums) for sums in self.earlier]
        self.residual, self.sent = {}, {}
        self._sizes = {}
        self._sampled.reset()

    def forget(self, layers: Collection[int]) -> None:
        """Drop the shadows of every unit that holds one of ``layers`` and those of the
        tensors ``layers`` themselves, tensors that no longer exist (a chunk of a unit that
        DDP's bucket rebuild retired, :meth:`gravac.engine.Engine.forget`)."""
        gone = set(layers)
        for store in (self.residual, self.sent):
            for unit in [k for k in store if gone & set(k[1])]:
                del store[unit]
        for pieces in (*self._loose.values(), *self.earlier):
            for piece in [k for k in pieces if k[1] in gone]:
                del pieces[piece]
        self._sizes = {unit: n for unit, n in self._sizes.items() if not gone & set(unit)}

    def rescale(self, factor: float) -> None:
        """Multiply every shadow residual and sum kept by ``factor`` (gradients whose unit
        changed: :meth:`gravac.memory.Memory.rescale`)."""
        held = [*self.residual.values(), *self.sent.values()]
        held += [t for pieces in (*self._loose.values(), *self.earlier) for t in pieces.values()]
        for t in held:
            t.mul_(factor)

    def clear(self, keep: int = 0) -> None:
        """Start a new window: the sums restart (those of the last ``keep`` windows, the one
        that ended included, stay in the terms of the next window's end), the shadow
        residuals carry on, and the sample indices of layouts the ended window did not read
        are dropped (a bucket rebuild's old layout would otherwise stay cached for the rest
        of the run)."""
        self.earlier = [*self.earlier, self._by_tensor("sent")][-keep:] if keep else []
        self.sent = {}
        self._loose["sent"] = {}
        self._sampled.prune()

    def state_dict(self) -> dict[str, Any]:
        """The shadows as rows ``(cf, layers, sizes, flat)``: the pieces (as in :meth:`piece`)
        of ``layers``, of ``sizes`` elements each, laid end to end in ``flat``; a row per unit
        and CF, and per CF and dtype for the pieces held by layer."""
        return {
            "version": _VERSION,
            "stride": self.stride,
            "residual": self._rows("residual"),
            "sent": self._rows("sent"),
            "earlier": [_grouped(sums) for sums in self.earlier],
        }

    def _rows(self, name: str) -> list[_Row]:
        """The ``name`` store's rows (:meth:`state_dict`): its units', then its loose pieces'."""
        units = sorted(getattr(self, name).items())
        rows = [(cf, list(unit), list(self._sizes[unit]), t.clone()) for (cf, unit), t in units]
        return rows + _grouped(self._loose[name])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the shadows (joined into units at their first use) and the stride they
        were sampled at (an older gravac's: the base stride); a state of another version (or
        none) starts them afresh."""
        version = state.get("version")
        self.stride = int(state.get("stride", SHADOW_STRIDE))
        self._sampled, self._sizes = Sampler(self.stride), {}

        def table(rows: list[Any]) -> dict[tuple[float, int], Tensor]:
            if version == 1:  # a tensor per CF and layer
                return {(float(cf), int(k)): torch.as_tensor(t).clone() for cf, k, t in rows}
            out = {}
            for cf, layers, sizes, flat in rows:
                pieces = torch.as_tensor(flat).clone().split([int(n) for n in sizes])
                out.update({(float(cf), int(k)): t for k, t in zip(layers, pieces, strict=True)})
            return out

        def stored(key: str) -> Any:
            return state.get(key, []) if version in _READS else []

        self.residual, self.sent = {}, {}
        self._loose = {"residual": table(stored("residual")), "sent": table(stored("sent"))}
        self.earlier = [table(rows) for rows in stored("earlier")]


def _grouped(pieces: dict[tuple[float, int], Tensor]) -> list[_Row]:
    """Rows of flat pieces held by ``(cf, layer)``: one per CF and dtype, layers ascending."""
    groups: dict[tuple[float, str], list[tuple[int, Tensor]]] = {}
    for (cf, layer), t in pieces.items():
        groups.setdefault((cf, str(t.dtype)), []).append((layer, t))
    rows = []
    for (cf, _), items in sorted(groups.items()):
        items.sort(key=lambda item: item[0])
        flat = torch.cat([t.reshape(-1) for _, t in items])
        rows.append((cf, [k for k, _ in items], [t.numel() for _, t in items], flat))
    return rows
