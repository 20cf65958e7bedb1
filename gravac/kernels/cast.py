"""16-bit casts fused with the world-size scaling (the fp16 / bf16 compressors).

``scaled_cast(x, dtype, divisor) = (clamp(float32(x), -M, M) * fl32(1 / divisor)).to(dtype)``
with ``M`` the format's largest finite value: a finite value never becomes Inf, NaN stays NaN,
and the all-reduced sum of ``divisor`` contributions stays in range (as PyTorch's
``fp16_compress_hook``, which divides before the cast). Multiplying by the rounded reciprocal,
not dividing, is what torch's CUDA division by a scalar computes, so the torch reference and the
CuPy kernel (one fused pass, :mod:`gravac.kernels.cupy_cast`) agree bit for bit on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gravac.kernels import cupy_cast
from gravac.kernels.backend import resolve_backend

__all__ = ["scaled_cast"]


def scaled_cast(
    x: Tensor, dtype: torch.dtype, *, divisor: int = 1, backend: str | None = None
) -> Tensor:
    """Flat ``x`` clamped to ``dtype``'s finite range, scaled by ``1 / divisor``, cast.

    Raises:
        ValueError: ``dtype`` is not float16 or bfloat16, or ``divisor`` is below 1.
    """
    if dtype not in cupy_cast.WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {list(cupy_cast.WIRE_DTYPES)}, got {dtype}")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be an int >= 1, got {divisor!r}")
    limit = torch.finfo(dtype).max
    scale = 1.0 / divisor
    flat = x.detach().reshape(-1)
    if (
        resolve_backend(flat, backend, op="scaled_cast", cupy=cupy_cast.supports(x, dtype))
        == "cupy"
    ):
        return cupy_cast.scaled_cast(flat, dtype, limit, scale)
    return flat.float().clamp(-limit, limit).mul_(scale).to(dtype)
