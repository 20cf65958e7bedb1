"""16-bit casts fused with the world-size scaling (the fp16 / bf16 compressors).

``scaled_cast(x, dtype, divisor, exponent) = (clamp(float32(x), -B, B) * fl32(2^exponent /
divisor)).to(dtype)`` with ``B = M * divisor / 2^exponent`` (capped at float32's largest value),
the pre-image of the format's largest finite value ``M``: a finite value never becomes Inf, NaN
stays NaN, the all-reduced sum of ``divisor`` contributions stays in range (as PyTorch's
``fp16_compress_hook``, which divides before the cast), and the power-of-two ``exponent`` moves
the values into the format's range exactly (:class:`gravac.compressors.dense.FP16Compressor`).
Multiplying by the rounded reciprocal, not dividing, is what torch's CUDA division by a scalar
computes, so the torch reference and the CuPy kernel (one fused pass,
:mod:`gravac.kernels.cupy_cast`) agree bit for bit on every device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gravac.kernels import cupy_cast
from gravac.kernels.backend import resolve_backend

__all__ = ["scaled_cast"]


def scaled_cast(
    x: Tensor,
    dtype: torch.dtype,
    *,
    divisor: int = 1,
    exponent: int = 0,
    backend: str | None = None,
) -> Tensor:
    """Flat ``x`` clamped to ``dtype``'s finite range, scaled by ``2^exponent / divisor``, cast.

    Raises:
        ValueError: ``dtype`` is not float16 or bfloat16, or ``divisor`` is below 1.
    """
    if dtype not in cupy_cast.WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {list(cupy_cast.WIRE_DTYPES)}, got {dtype}")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be an int >= 1, got {divisor!r}")
    scale = math.ldexp(1.0, exponent) / divisor
    bound = min(torch.finfo(dtype).max / scale, torch.finfo(torch.float32).max)
    flat = x.detach().reshape(-1)
    if (
        resolve_backend(flat, backend, op="scaled_cast", cupy=cupy_cast.supports(x, dtype))
        == "cupy"
    ):
        return cupy_cast.scaled_cast(flat, dtype, bound, scale)
    return flat.float().clamp(-bound, bound).mul_(scale).to(dtype)
