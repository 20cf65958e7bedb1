"""Dense baselines: no compression, and the 16-bit casts.

``none`` sends the tensor as it is (CF 1): the null compressor. ``fp16`` and ``bf16`` cast to 16
bits (CF 2): the strong baseline that the "Beyond Throughput" note asks every compression scheme to
beat, as PyTorch's ``fp16_compress_hook`` does. Like that hook they divide by the world size ``N``
*before* the cast, so that the all-reduced sum of ``N`` contributions stays in the 16-bit range.
Unlike that hook they also scale by a power of two ``2^k`` chosen from the largest magnitude ``m``
over all ranks (agreed through :meth:`local_stats`, reduced by ``"max"``): ``k = floor(log2(M / (2
m)))``, so the largest value lands in ``(M/4, M/2]`` of the format's largest finite value ``M``.
Gradients above fp16's 65504 are then sent, not clamped (a clamp kept a high gain while the residual
grew without bound), and small ones keep their precision instead of underflowing; the scaling is
exact, undone after aggregation. Each contribution is still clamped to ``M / (2 N)`` (a no-op unless
the agreed maximum is wrong), so that the all-reduced sum of ``N`` of them, rounded at every
addition, stays finite (:data:`_SUM_HEADROOM`): the mean is then finite without a pass over it
(:meth:`_HalfCompressor.mean_bound`). Under error feedback ``m`` is the previous step's, agreed
beside that step's scalars (:attr:`gravac.compressors.base.StatsRule.may_lag`), so that no blocking
collective waits behind the payloads in flight; the scale then leaves room for ``m`` to grow 16
times, and what a larger jump clamps stays in the residual, sent at the next step.

The optimizer packs them into buckets of :data:`CAST_BUCKET_BYTES` (more for a model of over
32 MiB of compressed gradient: :func:`gravac.buckets.default_bucket_bytes`) unless told
otherwise (:attr:`Compressor.bucket_bytes`): a cast costs about the same per element in a piece
as in a whole layer, so pieces pipeline the cast with the wire at little cost (the DDP comm
hook casts DDP's buckets as they come).

The cast, its inverse and the residual update run as one chunked pass each on the CPU
(:mod:`gravac.kernels.cast`, bit-identical to the whole-tensor references), into payload and
output buffers reused once the caller holds none of them (:class:`gravac.kernels.buffers.
BufferPool`): a fresh 32 MiB payload costs more in page faults than the cast itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor

from gravac.compressors.base import (
    REFERENCE_BITS,
    Collective,
    Compressor,
    Context,
    Payload,
    Round,
    StatsRule,
    agreed_stats,
)
from gravac.compressors.registry import register
from gravac.gain import inner, squared_norm
from gravac.kernels import check_backend_name, scaled_cast
from gravac.kernels.buffers import BufferPool
from gravac.kernels.cast import scaled_widen, sub_scaled_
from gravac.memory import Memory, NoMemory
from gravac.spans import Place, span_pieces

__all__ = [
    "CAST_BUCKET_BYTES",
    "BF16Compressor",
    "DensePayload",
    "FP16Compressor",
    "NoneCompressor",
]

#: The power-of-two shifts ``k`` taken, float32's smallest normal and largest powers of two (so
#: that ``2^k`` is a normal, finite float32): fp16's shift of float32's largest value is -114;
#: a shift of 127 lifts float32's smallest subnormal (2^-149) into fp16's subnormals (>= 2^-24),
#: so no float32 gradient underflows. (A cap of +-64 sent magnitudes below 2^-89, about 1.6e-27,
#: as zeros, kept fewer bits below 2^-78, and clamped those above 2^79, about 6e23.)
_MIN_EXPONENT, _MAX_EXPONENT = -126, 127
#: with the previous step's largest magnitude, the scale leaves room for the largest value to
#: grow this many times (4 of fp16's 40 binary orders of magnitude) before the clamp engages
_LAG_HEADROOM = 16.0
#: each rank's value is at most ``M / (2 N)``: the sum of ``N`` of them, rounded at each of the
#: ``N`` additions by at most a factor ``1 + u`` (``u`` the format's unit roundoff), stays under
#: ``M`` while ``(1 + u)^N <= 2``: up to 1419 ranks in fp16, 177 in bf16
_SUM_HEADROOM = 2.0
#: the optimizer's default bucket for the casts: a large layer is cast and sent in pieces of
#: 2 MiB, so the first piece is on the wire while the next is cast. On the VGG-style digits CNN
#: at 1 Gbit/s (its 21 MB layer in 10 pieces) the step went from 1.09-1.12x PyTorch's fp16 hook
#: in 25 MiB buckets to 0.99-1.03x (four runs); 1 MiB (the per-bucket work) and 4 MiB (a longer
#: first cast) were slower (benchmarks/README.md, tenth measurement). A large model's buckets
#: are larger (:data:`gravac.buckets.MAX_SMALL_BUCKETS`)
CAST_BUCKET_BYTES = 2 * 2**20


@dataclass(frozen=True)
class DensePayload(Payload):
    """The whole tensor, flat, in the wire dtype."""

    values: Tensor


@dataclass(frozen=True)
class ScaledContext(Context):
    """Context of a cast: ``scale`` (``N / 2^k``) undoes the scaling before the cast."""

    scale: float = 1.0


@register
class NoneCompressor(Compressor):
    """No compression (CF 1), the null object: the values travel as they are."""

    name: ClassVar[str] = "none"
    collective: Collective = "allreduce"
    sends_input: ClassVar[bool] = True

    def deliverable_cf(self, cf: float, world_size: int = 1) -> float:
        """Always 1: the values travel as they are."""
        return 1.0

    def make_memory(self) -> Memory:
        """No residual: everything is sent, so error feedback would keep zeros (a gradient-sized
        buffer and an addition a step for nothing)."""
        return NoMemory()

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[DensePayload, Context]:
        """The payload is ``x`` itself, flat (a view where ``x`` is contiguous): no copy."""
        flat = x.detach().reshape(-1)
        return DensePayload(values=flat), Context(x.shape, x.dtype, flat.numel(), 1.0)

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        return cast(DensePayload, payload).values.to(ctx.dtype).view(ctx.shape)

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """Everything was sent: zero (its storage is reused by the next step)."""
        return x.zero_()

    def sent_terms(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """What is sent is ``x``: both terms are ``||x||^2`` (one pass)."""
        xx = squared_norm(x)
        return torch.stack([xx, xx])


class _HalfCompressor(Compressor):
    """Send ``clamp(x * 2^k, +-max) / N`` in :attr:`wire_dtype`; decompression multiplies by
    ``N / 2^k`` (module docstring).

    Args:
        backend: kernel backend of the cast (:func:`gravac.kernels.scaled_cast`; ``None`` picks
            the best available).
    """

    collective: Collective = "allreduce"
    #: the largest magnitude over ranks, which may be the previous step's under error feedback
    #: and is NaN or Inf with x
    stats_rule: ClassVar[StatsRule] = StatsRule(op="max", may_lag=True, shows_nonfinite=True)
    bucket_bytes: ClassVar[int | None] = CAST_BUCKET_BYTES
    wire_dtype: ClassVar[torch.dtype]

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = check_backend_name(backend)
        # payloads and decompressed tensors, reused once the caller has dropped them
        self._buffers = BufferPool()

    def deliverable_cf(self, cf: float, world_size: int = 1) -> float:
        """Always 2 (16 of 32 bits), whatever is asked."""
        return REFERENCE_BITS / torch.finfo(self.wire_dtype).bits

    def forget(self, key: int) -> None:
        """Drop the payload buffer of unit ``key``."""
        self._buffers.drop(("payload", key))

    def local_stats(self, x: Tensor, cf: float, rnd: Round) -> Tensor | None:
        """This rank's largest magnitude (NaN if ``x`` holds NaN)."""
        if x.numel() == 0:
            return None
        lo, hi = torch.aminmax(x.detach().reshape(-1))  # no |x| copy; NaN propagates
        return torch.maximum(lo.abs(), hi.abs()).float().reshape(1)

    def exponent(self, x: Tensor, rnd: Round) -> int:
        """``k``: ``m * 2^k <= M / 2`` for the agreed largest magnitude ``m``, largest such ``k``
        (:data:`_SUM_HEADROOM`).

        Raises:
            ValueError: ``rnd.agreed`` is missing with more than one rank.
        """
        stats = agreed_stats(self, x, 1.0, rnd)
        m = 0.0 if stats is None else float(stats.reshape(-1)[0])
        if rnd.stale:
            m *= _LAG_HEADROOM
        limit = torch.finfo(self.wire_dtype).max / _SUM_HEADROOM
        if not math.isfinite(m) or m <= 0.0:
            return 0
        k = max(_MIN_EXPONENT, min(_MAX_EXPONENT, math.floor(math.log2(limit / m))))
        while k > _MIN_EXPONENT and math.ldexp(m, k) > limit:  # log2's rounding, at the edge
            k -= 1
        return k

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[DensePayload, ScaledContext]:
        flat = x.detach().reshape(-1)
        k = self.exponent(flat, rnd)
        out = self._buffers.empty(flat.numel(), self.wire_dtype, flat.device, ("payload", rnd.key))
        limit = torch.finfo(self.wire_dtype).max / (_SUM_HEADROOM * rnd.world_size)
        values = scaled_cast(
            flat,
            self.wire_dtype,
            divisor=rnd.world_size,
            exponent=k,
            limit=limit,
            backend=self.backend,
            out=out,
        )
        achieved = self.deliverable_cf(cf) if flat.numel() else 1.0
        ctx = ScaledContext(
            x.shape, x.dtype, flat.numel(), achieved, scale=math.ldexp(rnd.world_size, -k)
        )
        return DensePayload(values=values), ctx

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        return self.combine([payload], ctx)

    def combine(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None = None
    ) -> Tensor:
        """``s (v_1 + ... + v_n)``: the 16-bit values summed in 16 bits (as the all-reduce sums
        them), widened and scaled in one pass (:func:`gravac.kernels.cast.scaled_widen`)."""
        if not payloads:
            raise ValueError("combine() needs at least one payload, got none")
        values = [cast(DensePayload, p).values.reshape(-1) for p in payloads]
        if out is None:
            out = self._buffers.empty(ctx.numel, ctx.dtype, values[0].device, "decompressed")
        return scaled_widen(values, cast(ScaledContext, ctx).scale, out).view(ctx.shape)

    def combine_mean(
        self,
        payloads: Sequence[Payload],
        ctx: Context,
        world_size: int,
        out: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`combine` with the scale divided by ``world_size``: ``s = N / 2^k`` becomes
        ``2^-k`` exactly, so the division costs no pass of its own."""
        c = cast(ScaledContext, ctx)
        return self.combine(payloads, dataclasses.replace(c, scale=c.scale / world_size), out)

    def combine_mean_placed(
        self, payloads: Sequence[Payload], ctx: Context, world_size: int, place: Place
    ) -> bool:
        """:meth:`combine_mean` widened span by span into the place: each element's sum and
        scaling as in the flat result."""
        out, spans = place
        scale = cast(ScaledContext, ctx).scale / world_size
        values = [cast(DensePayload, p).values.reshape(-1) for p in payloads]
        for in_out, in_flat in span_pieces(spans):
            scaled_widen([v[in_flat] for v in values], scale, out[in_out])
        return True

    def mean_bound(self, ctx: Context, world_size: int, x_bound: float) -> float | None:
        """``M 2^-k``: the 16-bit sum stays under ``M`` (:data:`_SUM_HEADROOM`; ``None`` for
        more ranks than it covers), and the mean is that sum times ``2^-k``."""
        unit_roundoff = torch.finfo(self.wire_dtype).eps / 2
        if (1.0 + unit_roundoff) ** world_size > _SUM_HEADROOM:
            return None
        return torch.finfo(self.wire_dtype).max * cast(ScaledContext, ctx).scale / world_size

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """``x - s v`` in place, without the scaled copy (``s v`` is exact: ``s`` is a power of
        two times the world size, so this equals ``x - D(payload)``)."""
        values = cast(DensePayload, payload).values
        return sub_scaled_(x, values, cast(ScaledContext, ctx).scale)

    def sent_terms(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """From the 16-bit values ``v`` and the scale ``s`` of ``c = s v``: ``s <v, x>`` and
        ``s^2 ||v||^2``, without decompressing."""
        v, scale = cast(DensePayload, payload).values, cast(ScaledContext, ctx).scale
        return torch.stack([inner(v, x) * scale, squared_norm(v) * scale**2])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r})"


@register
class FP16Compressor(_HalfCompressor):
    """IEEE half precision (CF 2)."""

    name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@register
class BF16Compressor(_HalfCompressor):
    """bfloat16 (CF 2): float32's range with 8 bits of mantissa."""

    name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
