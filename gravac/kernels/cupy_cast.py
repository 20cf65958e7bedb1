"""CuPy kernel of :func:`gravac.kernels.cast.scaled_cast` (``cuda/cast.cu``): one pass."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gravac.kernels.cupy_runtime import (
    BLOCK_THREADS,
    C_TYPES,
    FLOAT_DTYPES,
    as_cupy,
    grid_for,
    kernel,
    launch,
    torch_stream,
)

__all__ = ["WIRE_DTYPES", "scaled_cast", "supports"]

#: The 16-bit wire formats.
WIRE_DTYPES = (torch.float16, torch.bfloat16)
_SOURCE = "cast.cu"
_EXPRESSIONS = tuple(
    f"scaled_cast<{C_TYPES[i]},{C_TYPES[o]}>" for i in FLOAT_DTYPES for o in WIRE_DTYPES
)


def supports(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel casts ``x`` to ``dtype``."""
    return x.dtype in FLOAT_DTYPES and dtype in WIRE_DTYPES


def scaled_cast(
    x: Tensor, dtype: torch.dtype, limit: float, scale: float, out: Tensor | None = None
) -> Tensor:
    """``narrow(clamp(float(x), +-limit) * scale)`` of CUDA ``x``, flat, in ``dtype`` (written
    into ``out``, a contiguous flat tensor of that dtype, if given)."""
    x = x.reshape(-1).contiguous()
    if out is None:
        out = torch.empty(x.numel(), dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out
    name = f"scaled_cast<{C_TYPES[x.dtype]},{C_TYPES[dtype]}>"
    args = (as_cupy(x), as_cupy(out), np.int64(x.numel()), np.float32(limit), np.float32(scale))
    with torch_stream(x.device):
        fn = kernel(_SOURCE, _EXPRESSIONS, name)
        launch(fn, grid_for(x.numel(), x.device), BLOCK_THREADS, args)
    return out
