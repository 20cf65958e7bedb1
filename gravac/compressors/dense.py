"""Dense baselines: no compression, and the 16-bit casts.

``none`` sends the tensor as it is (CF 1): the null compressor. ``fp16`` and ``bf16`` cast to 16
bits (CF 2): the strong baseline that the "Beyond Throughput" note asks every compression scheme to
beat, as PyTorch's ``fp16_compress_hook`` does. Like that hook they divide by the world size
``N`` *before* the cast, so that the all-reduced sum of ``N`` contributions stays in the 16-bit
range; each contribution is first clamped to the format's largest finite value, so a finite
gradient never becomes Inf and what the clamp cuts off stays in the error-feedback residual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor

from gravac.compressors.base import REFERENCE_BITS, Collective, Compressor, Context, Payload, Round
from gravac.compressors.registry import register
from gravac.kernels import check_backend_name, scaled_cast

__all__ = ["BF16Compressor", "DensePayload", "FP16Compressor", "NoneCompressor"]


@dataclass(frozen=True)
class DensePayload(Payload):
    """The whole tensor, flat, in the wire dtype."""

    values: Tensor


@dataclass(frozen=True)
class ScaledContext(Context):
    """Context of a cast: ``scale`` undoes the pre-division by the world size."""

    scale: int = 1


@register
class NoneCompressor(Compressor):
    """No compression (CF 1), the null object: the values travel as they are."""

    name: ClassVar[str] = "none"
    collective: Collective = "allreduce"

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[DensePayload, Context]:
        flat = x.detach().reshape(-1).clone()
        return DensePayload(values=flat), Context(x.shape, x.dtype, flat.numel(), 1.0)

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        return cast(DensePayload, payload).values.to(ctx.dtype).view(ctx.shape)


class _HalfCompressor(Compressor):
    """Send ``clamp(x, +-max) / N`` in :attr:`wire_dtype`; decompression multiplies by ``N``.

    Args:
        backend: kernel backend of the cast (:func:`gravac.kernels.scaled_cast`; ``None`` picks
            the best available).
    """

    collective: Collective = "allreduce"
    wire_dtype: ClassVar[torch.dtype]

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = check_backend_name(backend)

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[DensePayload, ScaledContext]:
        flat = x.detach().reshape(-1)
        values = scaled_cast(flat, self.wire_dtype, divisor=rnd.world_size, backend=self.backend)
        achieved = REFERENCE_BITS / torch.finfo(self.wire_dtype).bits if flat.numel() else 1.0
        ctx = ScaledContext(x.shape, x.dtype, flat.numel(), achieved, scale=rnd.world_size)
        return DensePayload(values=values), ctx

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        values = cast(DensePayload, payload).values.to(ctx.dtype)
        return (values * cast(ScaledContext, ctx).scale).view(ctx.shape)

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
