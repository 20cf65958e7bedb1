"""In-process simulation of N workers aggregating compressed gradients.

Runs one round exactly as the compressor's collective would across real ranks, without
``torch.distributed``: every worker computes its local stats, the stats are reduced
(:attr:`gravac.compressors.base.Agreeing.stats_rule`), every worker compresses with the agreed
values, the payloads are aggregated (:meth:`Compressor.combine`: summed then decompressed for
all-reduce compressors, decompressed then summed for all-gather ones) and the sum is divided by N::

    mean_hat = (1/N) * combine([C(x_1), ..., C(x_N)])   with x_i = g_i + e_i under EF

Tests compare the real process-group path against this; benchmarks use it for NMSE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gravac.compressors.base import (
    Compressor,
    Context,
    Payload,
    Round,
    check_cf,
    local_stats,
    stats_rule,
    wire_bytes,
)
from gravac.memory import Memory

__all__ = ["SimulationResult", "reduce_stats", "simulate"]


@dataclass(frozen=True)
class SimulationResult:
    """One simulated round.

    Attributes:
        mean: the estimate of the mean gradient every worker ends up with.
        sent: per worker, the dense ``D(C(x_i))`` its error feedback is updated with.
        compensated: per worker, ``x_i`` (the gradient plus its residual).
        wire_bytes: bytes one worker's payload puts on the wire (per worker).
        achieved_cf: the CF achieved (worker 0's; identical on all workers for every compressor).
    """

    mean: Tensor
    sent: list[Tensor]
    compensated: list[Tensor]
    wire_bytes: list[int]
    achieved_cf: float


def reduce_stats(compressor: Compressor, stats: Sequence[Tensor | None]) -> Tensor | None:
    """Reduce per-worker :meth:`Compressor.local_stats` as the collective would."""
    if all(s is None for s in stats):
        return None
    if any(s is None for s in stats):
        raise ValueError("local_stats must be given by every worker or by none")
    stacked = torch.stack([s for s in stats if s is not None])
    rule = stats_rule(compressor)
    return stacked.amax(dim=0) if rule is not None and rule.op == "max" else stacked.sum(dim=0)


def simulate(
    compressor: Compressor,
    grads: Sequence[Tensor],
    cf: float,
    *,
    step: int = 0,
    key: int = 0,
    memories: Sequence[Memory] | None = None,
    layout: tuple[torch.Size, ...] | None = None,
) -> SimulationResult:
    """Aggregate the per-worker ``grads`` at CF ``cf`` as the real collective would.

    Args:
        compressor: the compressor every worker uses (one instance, as each rank has its own copy
            of an identically configured compressor; stateful compressors keep state per key).
        grads: one gradient per worker, all of one shape and dtype.
        cf: requested compression factor (>= 1).
        step: the global step (seeds shared randomness).
        key: the bucket key.
        memories: one error-feedback memory per worker, updated in place; ``None`` for no EF.
        layout: shapes of the tensors packed, in order, into each flat gradient, passed to the
            compressor as :attr:`Round.layout` (per-matrix compressors such as PowerSGD read it);
            ``None`` when each gradient is a single tensor of its own shape.
    """
    check_cf(cf)
    if not grads:
        raise ValueError("grads must hold one gradient per worker, got an empty sequence")
    shapes = {(tuple(g.shape), g.dtype) for g in grads}
    if len(shapes) != 1:
        raise ValueError(f"grads must share one shape and dtype, got {sorted(map(str, shapes))}")
    if memories is not None and len(memories) != len(grads):
        raise ValueError(f"memories must be one per worker: {len(memories)} for {len(grads)}")
    n = len(grads)
    xs = (
        [m.compensate(key, g) for m, g in zip(memories, grads, strict=True)]
        if memories
        else [g.detach() for g in grads]
    )
    probe = Round(step=step, key=key, world_size=n, layout=layout)
    agreed = reduce_stats(compressor, [local_stats(compressor, x, cf, probe) for x in xs])
    rnd = Round(step=step, key=key, world_size=n, agreed=agreed, layout=layout)
    compressed: list[tuple[Payload, Context]] = [compressor.compress(x, cf, rnd) for x in xs]
    payloads = [p for p, _ in compressed]
    ctx = compressed[0][1]
    mean = compressor.combine_mean(payloads, ctx, n)  # as the engine averages
    sent = [compressor.decompress(p, c) for p, c in compressed]
    if memories:
        for m, x, s in zip(memories, xs, sent, strict=True):
            m.update(key, x, s)
    return SimulationResult(
        mean=mean,
        sent=sent,
        compensated=xs,
        wire_bytes=[wire_bytes(p) for p in payloads],
        achieved_cf=ctx.achieved_cf,
    )
