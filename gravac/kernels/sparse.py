"""Sparse selection and aggregation kernels: top-k, threshold select, scatter-add.

Torch implementations, vectorised, on any device, and CuPy kernels for CUDA tensors
(:mod:`gravac.kernels.cupy_sparse`); see :mod:`gravac.kernels.backend`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gravac.kernels import cupy_sparse
from gravac.kernels.backend import resolve_backend

__all__ = ["index_dtype", "scatter_add", "threshold_indices", "topk_indices"]

#: Flat indices fit int32 (half the wire bytes of int64) below this many elements.
_INT32_LIMIT = 2**31 - 1


def index_dtype(numel: int) -> torch.dtype:
    """The narrowest index dtype that addresses ``numel`` elements."""
    return torch.int32 if numel <= _INT32_LIMIT else torch.int64


def topk_indices(x: Tensor, k: int, *, backend: str | None = None) -> Tensor:
    """Flat int64 indices of the ``k`` entries of largest magnitude of 1-D ``x``.

    NaN ranks above every number and +-Inf above every finite value, so non-finite entries are
    always selected first (they are sent, never hidden in a residual).
    """
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}] for {n} elements, got {k}")
    if resolve_backend(x, backend, op="topk", cupy=cupy_sparse.supports(x)) == "cupy":
        if k == 0 or k == n:
            return torch.arange(k, device=x.device)
        return cupy_sparse.topk_indices(x, k)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    mag = x.abs()
    if not x.is_floating_point() or mag.dtype in (torch.float16, torch.bfloat16):
        mag = mag.float()
    return torch.topk(mag, k, sorted=False).indices


def threshold_indices(x: Tensor, threshold: float, *, backend: str | None = None) -> Tensor:
    """Flat int64 indices of the entries of 1-D ``x`` with ``|x| >= threshold``, ascending."""
    if resolve_backend(x, backend, op="threshold", cupy=cupy_sparse.supports(x)) == "cupy":
        return cupy_sparse.threshold_indices(x, threshold)
    return torch.nonzero(x.abs() >= threshold).reshape(-1)


def scatter_add(
    numel: int, indices: Tensor, values: Tensor, *, backend: str | None = None
) -> Tensor:
    """Dense 1-D tensor of ``numel`` zeros with ``values`` added at ``indices`` (sums repeats)."""
    cupy = cupy_sparse.supports(values)
    if resolve_backend(values, backend, op="scatter_add", cupy=cupy) == "cupy":
        return cupy_sparse.scatter_add(numel, indices, values)
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    return out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1))
