"""CuPy kernels of :mod:`gravac.kernels.sparse` (``cuda/sparse.cu``).

Exact top-k by threshold refinement, in three passes over the input:

1. a histogram of a 12-bit magnitude key (the top bits of ``|x|``'s bit pattern, which orders
   like ``|x|`` with NaN above Inf above every finite value) locates the bin ``b`` holding the
   k-th largest magnitude: every element in a higher bin is selected, those in ``b`` are the
   candidates;
2. a count pass and 3. a write pass compact both sets, in ascending index order, with per-tile
   counts and an exclusive scan (deterministic, no atomics on the output);

then torch's exact top-k over the few candidates picks the missing ``k - above``. Threshold
selection (``|x| >= t``) is the same count and write passes.
"""

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

__all__ = ["scatter_add", "supports", "threshold_indices", "topk_indices"]

_SOURCE = "sparse.cu"
_MODES = {"topk": 0, "threshold": 1}
_INDEX_TYPES = (torch.int32, torch.int64)
_EXPRESSIONS = (
    "find_bin",
    *(f"mag_histogram<{C_TYPES[d]}>" for d in FLOAT_DTYPES),
    *(f"compact_count<{m},{C_TYPES[d]}>" for m in _MODES.values() for d in FLOAT_DTYPES),
    *(f"compact_write<{m},{C_TYPES[d]}>" for m in _MODES.values() for d in FLOAT_DTYPES),
    *(f"scatter_add<{C_TYPES[d]},{C_TYPES[i]}>" for d in FLOAT_DTYPES for i in _INDEX_TYPES),
)
#: Histogram bins (NBINS in sparse.cu) and the threads of the one block that scans them.
_BINS = 4096
_FIND_THREADS = 1024
#: Elements per tile of the histogram and compaction passes (TILE in sparse.cu: 256 threads x 8).
_TILE_ITEMS = 8
_TILE = 256 * _TILE_ITEMS
#: Counts are int32 and indices fit int64: tensors up to 2^31 - 1 elements.
_MAX_NUMEL = 2**31 - 1


def supports(x: Tensor) -> bool:
    """Whether these kernels take ``x``: a floating-point tensor below 2^31 elements."""
    return x.dtype in FLOAT_DTYPES and x.numel() <= _MAX_NUMEL


def _fn(name: str):  # type: ignore[no-untyped-def]
    return kernel(_SOURCE, _EXPRESSIONS, name)


def _compact(
    x: Tensor, mode: str, *, bin_: int = 0, threshold: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Per-tile exclusive offsets ``[2, tiles]`` (int64) and totals ``[2]`` of both streams."""
    n = x.numel()
    tiles = -(-n // _TILE)
    counts = torch.empty(2, tiles, dtype=torch.int32, device=x.device)
    name = f"compact_count<{_MODES[mode]},{C_TYPES[x.dtype]}>"
    args = (as_cupy(x), np.int64(n), np.int32(bin_), np.float64(threshold), as_cupy(counts))
    launch(_fn(name), tiles, BLOCK_THREADS, args)
    inclusive = counts.to(torch.int64).cumsum_(1)
    return inclusive - counts, inclusive.sum(1) if tiles == 0 else inclusive[:, -1]


def _write(
    x: Tensor, mode: str, offsets: Tensor, out1: Tensor, out2: Tensor, **params: float
) -> None:
    tiles = offsets.shape[1]
    name = f"compact_write<{_MODES[mode]},{C_TYPES[x.dtype]}>"
    args = (
        as_cupy(x),
        np.int64(x.numel()),
        np.int32(params.get("bin_", 0)),
        np.float64(params.get("threshold", 0.0)),
        as_cupy(offsets),
        as_cupy(out1),
        as_cupy(out2),
    )
    launch(_fn(name), tiles, BLOCK_THREADS, args)


def topk_indices(x: Tensor, k: int) -> Tensor:
    """int64 indices of the ``k`` largest ``|x|`` of 1-D CUDA ``x`` (``0 < k < x.numel()``).

    The entries above the k-th largest's bin come first, ascending, then the chosen candidates.
    """
    x = x.contiguous()
    n = x.numel()
    with torch_stream(x.device):
        hist = torch.zeros(_BINS, dtype=torch.int32, device=x.device)
        grid = grid_for(-(-n // _TILE_ITEMS), x.device)  # a tile per block and round
        args = (as_cupy(x), np.int64(n), as_cupy(hist))
        launch(_fn(f"mag_histogram<{C_TYPES[x.dtype]}>"), grid, BLOCK_THREADS, args)
        found = torch.empty(3, dtype=torch.int64, device=x.device)
        args = (as_cupy(hist), np.int64(k), as_cupy(found))
        launch(_fn("find_bin"), 1, _FIND_THREADS, args)
        bin_, above, n_candidates = found.tolist()
        offsets, _ = _compact(x, "topk", bin_=bin_)
        out = torch.empty(k, dtype=torch.int64, device=x.device)
        candidates = torch.empty(n_candidates, dtype=torch.int64, device=x.device)
        _write(x, "topk", offsets, out, candidates, bin_=bin_)
    need = k - above
    if need < n_candidates:
        mag = x[candidates].abs()
        if mag.dtype in (torch.float16, torch.bfloat16):
            mag = mag.float()
        candidates = candidates[torch.topk(mag, need, sorted=False).indices]
    out[above:] = candidates
    return out


def threshold_indices(x: Tensor, threshold: float) -> Tensor:
    """int64 indices of the entries of 1-D CUDA ``x`` with ``|x| >= threshold``, ascending.

    Compared as torch's CUDA comparison with a Python scalar does: the threshold rounded to
    ``x``'s dtype, 16-bit values compared in float32.
    """
    x = x.contiguous()
    if x.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    threshold = float(torch.tensor(threshold, dtype=x.dtype))
    with torch_stream(x.device):
        offsets, totals = _compact(x, "threshold", threshold=threshold)
        out = torch.empty(int(totals[0]), dtype=torch.int64, device=x.device)
        _write(x, "threshold", offsets, out, out, threshold=threshold)
    return out


def scatter_add(numel: int, indices: Tensor, values: Tensor) -> Tensor:
    """Dense ``numel`` zeros with ``values`` added at ``indices`` (repeats summed, atomically)."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    k = values.numel()
    if k == 0:
        return out
    if indices.dtype not in _INDEX_TYPES:
        indices = indices.long()
    indices, values = indices.reshape(-1).contiguous(), values.reshape(-1).contiguous()
    name = f"scatter_add<{C_TYPES[values.dtype]},{C_TYPES[indices.dtype]}>"
    with torch_stream(values.device):
        args = (as_cupy(out), as_cupy(indices), as_cupy(values), np.int64(k))
        launch(_fn(name), grid_for(k, values.device), BLOCK_THREADS, args)
    return out
