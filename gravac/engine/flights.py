"""What a step's commit does with each unit in flight (:class:`~gravac.engine.records.Flight`):
its aggregate, the mean over ranks of what was sent, and its residual update
``e <- x - D(sent)`` (docs/design.md sections 4 and 5).

Plain functions of a flight and the engine's parts they read (the compressor, the error-feedback
memory, the number of ranks the unit is aggregated among); :class:`gravac.engine.Engine` calls
them in its commit's stages.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gravac.compressors.base import Compressor
from gravac.engine.records import Flight
from gravac.memory import Memory
from gravac.spans import scatter_spans

__all__ = [
    "absent_mask",
    "aggregate",
    "decompressed",
    "lay",
    "target",
    "update_memory",
    "vouched",
]

#: an aggregate is known finite, without a pass over it, when the compressor bounds every value
#: it computes (:meth:`Compressor.mean_bound`) by the dtype's largest finite value over this:
#: the bounds leave out rounding (a factor ``1 + 2^-24`` per addition in float32, far from 2)
_BOUND_MARGIN = 2.0


def aggregate(f: Flight, out: Tensor | None, c: Compressor, world: int) -> Tensor:
    """The mean over ``world`` ranks of what ``f`` sent, dense and flat, in ``out`` if given:
    the all-reduced tensor divided, or the compressor's combination of every rank's payload
    (once a step: it advances the compressor's shared state)."""
    arrived = f.arrived.value()
    if f.pieces:
        total = out if out is not None else torch.empty_like(f.x.reshape(-1))
        for p, payloads in zip(f.pieces, arrived, strict=True):
            p.by.combine_mean(payloads, p.ctx, world, out=total[p.start : p.end])
        return total
    if f.sent is None:
        total = arrived if out is None or out is arrived else out.copy_(arrived)
        return total.div_(world) if world > 1 else total
    return c.combine_mean(arrived, f.sent[1], world, out=out).reshape(-1)


def lay(
    f: Flight, target: Tensor | None, checked: Tensor | None, c: Compressor, world: int
) -> Tensor:
    """Lay ``f``'s aggregate into its place (``checked``: the aggregate, computed already);
    return a flat buffer the front end may reuse: ``target`` where the compressor wrote into
    the place itself, else the flat aggregate, copied into the place."""
    assert f.place is not None  # only called for a placed flight
    if checked is None and target is not None and f.sent is not None:
        payloads, (_, ctx) = f.arrived.value(), f.sent
        if c.combine_mean_placed(payloads, ctx, world, f.place):
            return target
    total = checked if checked is not None else aggregate(f, target, c, world)
    scatter_spans(*f.place, total)
    return total


def vouched(f: Flight, bound: float, c: Compressor, world: int) -> bool:
    """Whether ``f``'s aggregate is finite without a look at it: the compressor bounds every
    value aggregating it computes (:meth:`Compressor.mean_bound`), given the agreed ``bound``
    on every rank's ``max |x|``, well inside the dtype's range."""
    if f.sent is None:
        return False
    limit = torch.finfo(f.x.dtype).max / _BOUND_MARGIN
    b = c.mean_bound(f.sent[1], world, bound)
    return b is not None and b <= limit


def target(f: Flight, memory: Memory) -> Tensor | None:
    """Where ``f``'s vouched aggregate goes: ``f.out``; where ``f`` rotates, the old residual's
    storage, given up by the memory as ``x``'s becomes the residual (a new tensor, or the front
    end's spare, when there was none; dropped when the aggregate was checked elsewhere)."""
    if not f.rotate:
        return f.out
    assert f.residual is not None  # rotate: settled at launch
    old = memory.swap(f.unit.key, f.residual)
    if old is not None:
        return old
    return f.spare if f.spare is not None else torch.empty_like(f.residual.reshape(-1))


def update_memory(f: Flight, present: tuple[bool, ...], memory: Memory, c: Compressor) -> None:
    """``e <- x - D(sent)``; what belongs to a tensor with a gradient on no rank stays in the
    residual (it is applied to nothing); after a dense send, ``e <- 0``."""
    if f.residual is not None:  # settled at launch, where every tensor had a gradient
        if not f.rotate:  # a rotating one was swapped in by target()
            memory.keep(f.unit.key, f.residual)
        return
    absent = absent_mask(f, present)
    if f.dense and absent is None:
        memory.reset(f.unit.key)
        return
    if absent is None and f.sent is not None:
        memory.update_sent(f.unit.key, f.x, c, *f.sent)
        return
    applied = f.x if f.dense else decompressed(f, c)
    if absent is not None:
        applied = applied.masked_fill(absent, 0)
    memory.update(f.unit.key, f.x, applied)


def decompressed(f: Flight, c: Compressor) -> Tensor:
    """What ``f`` sent, dense (its pieces written side by side)."""
    if f.sent is not None:
        return c.decompress(*f.sent)
    dense = torch.empty_like(f.x.reshape(-1))
    for p in f.pieces:
        p.by.decompress_into(p.payload, p.ctx, dense[p.start : p.end])
    return dense


def absent_mask(f: Flight, present: tuple[bool, ...]) -> Tensor | None:
    """Where ``f``'s tensors have a gradient on no rank (``present``: per slot), as a mask of
    ``f``'s elements; ``None`` where every one has one."""
    if not f.unit.slots or all(present[i] for i in f.unit.slots):
        return None
    return torch.cat(
        [
            torch.full((math.prod(s),), not present[i], dtype=torch.bool, device=f.x.device)
            for s, i in zip(f.unit.shapes, f.unit.slots, strict=True)
        ]
    )
