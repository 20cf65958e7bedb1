"""CuPy kernels of :mod:`gravac.kernels.sparse` (``cuda/sparse.cu``).

Exact top-k by threshold refinement, in two passes over the input. A magnitude key (the bit
pattern of ``|x|`` as an integer, which orders like ``|x|`` with NaN above Inf above every finite
value) and a key range ``[lo, hi]`` split the input: every element above ``hi`` is selected, those
inside are the candidates. The range comes from a strided sample of :data:`_SAMPLE` elements (the
sample's quantile of the k-th largest, widened by a margin). A count pass checks it (fewer than
``k`` above, at least ``k`` above or inside); if the sample misled, or the input is small, a
4096-bin histogram of the key's top 12 bits gives the range instead. A write pass then compacts
both sets in ascending index order, with per-tile counts and an exclusive scan (deterministic, no
atomics on the output), and torch's exact top-k over the few candidates picks the missing
``k - above``. Threshold selection (``|x| >= t``) is the same count and write passes.
"""

from __future__ import annotations

import math

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

__all__ = ["mag_keys", "scatter_add", "supports", "threshold_indices", "topk_indices"]

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
#: The key's bin is its top 12 of 31 bits (KEY_SHIFT in sparse.cu); keys are below 2^31.
_KEY_SHIFT = 19
_KEY_MASK = 0x7FFFFFFF
_HIGH_WORD = 32
#: Elements of the strided sample that places the key range on large inputs (at most 256 KiB of
#: keys: a small top-k), and its margin on each side of the expected rank, in binomial standard
#: deviations plus a constant: the k-th largest falls outside with probability below 1e-4, and
#: then the histogram decides.
_SAMPLE = 65536
_SAMPLE_MARGIN_SDS = 4.0
_SAMPLE_MARGIN_MIN = 16
#: Counts are int32 and indices fit int64: tensors up to 2^31 - 1 elements.
_MAX_NUMEL = 2**31 - 1


def supports(x: Tensor) -> bool:
    """Whether these kernels take ``x``: a floating-point tensor below 2^31 elements."""
    return x.dtype in FLOAT_DTYPES and x.numel() <= _MAX_NUMEL


def _fn(name: str):  # type: ignore[no-untyped-def]
    return kernel(_SOURCE, _EXPRESSIONS, name)


def _compact(
    x: Tensor, mode: str, *, keys: tuple[int, int] = (0, 0), threshold: float = 0.0
) -> tuple[Tensor, list[int]]:
    """Per-tile exclusive offsets ``[2, tiles]`` (int64) and the totals of both streams.

    One host sync (the totals size the outputs).
    """
    n = x.numel()
    tiles = -(-n // _TILE)
    counts = torch.empty(2 * tiles, dtype=torch.int32, device=x.device)
    name = f"compact_count<{_MODES[mode]},{C_TYPES[x.dtype]}>"
    args = (as_cupy(x), np.int64(n), *_key_args(keys), np.float64(threshold), as_cupy(counts))
    launch(_fn(name), tiles, BLOCK_THREADS, args)
    # One flat scan (a 1-D cumsum is a single fast device scan), then stream 1 restarts at 0.
    exclusive = counts.to(torch.int64).cumsum_(0).sub_(counts).view(2, tiles)
    totals = torch.stack([exclusive[1, 0], exclusive[1, -1] + counts[-1]])
    exclusive[1] -= totals[0].clone()
    first, both = totals.tolist()
    return exclusive, [first, both - first]


def _key_args(keys: tuple[int, int]) -> tuple[np.uint32, np.uint32]:
    return np.uint32(keys[0]), np.uint32(keys[1])


def _write(
    x: Tensor,
    mode: str,
    offsets: Tensor,
    out1: Tensor,
    out2: Tensor,
    *,
    keys: tuple[int, int] = (0, 0),
    threshold: float = 0.0,
) -> None:
    tiles = offsets.shape[1]
    name = f"compact_write<{_MODES[mode]},{C_TYPES[x.dtype]}>"
    args = (
        as_cupy(x),
        np.int64(x.numel()),
        *_key_args(keys),
        np.float64(threshold),
        as_cupy(offsets),
        as_cupy(out1),
        as_cupy(out2),
    )
    launch(_fn(name), tiles, BLOCK_THREADS, args)


def mag_keys(x: Tensor) -> Tensor:
    """The kernels' 31-bit magnitude key of every element (int32): ``mag_key`` in sparse.cu.

    The bit pattern of ``|x|`` as an integer (16-bit floats widened to float32, float64 its upper
    32 bits): weakly increasing in ``|x|``, NaN above Inf above every finite value.
    """
    if x.dtype == torch.float64:
        return ((x.view(torch.int64) >> _HIGH_WORD) & _KEY_MASK).to(torch.int32)
    return x.float().view(torch.int32) & _KEY_MASK


def _sampled_keys(x: Tensor, k: int) -> tuple[int, int]:
    """A key range ``(lo, hi]`` likely to hold the k-th largest key: from a strided sample.

    The sample's ``k * S / n``-th largest key, widened by :data:`_SAMPLE_MARGIN_SDS` binomial
    standard deviations on each side (plus :data:`_SAMPLE_MARGIN_MIN`).
    """
    n = x.numel()
    stride = n // _SAMPLE
    keys = mag_keys(x[::stride][:_SAMPLE])
    expected = k * keys.numel() / n
    margin = int(_SAMPLE_MARGIN_SDS * math.sqrt(expected)) + _SAMPLE_MARGIN_MIN
    deepest = min(int(expected) + margin, keys.numel() - 1)
    top = torch.topk(keys, deepest + 1).values
    hi_rank = int(expected) - margin
    bounds = torch.stack([top[deepest], top[max(hi_rank, 0)]]).tolist()
    lo = bounds[0] if deepest < keys.numel() - 1 else 0
    hi = bounds[1] if hi_rank >= 0 else _KEY_MASK
    return int(lo), int(hi)


def _histogram_keys(x: Tensor, k: int) -> tuple[int, int]:
    """The key range of the 4096-bin histogram bin that holds the k-th largest key (exact)."""
    n = x.numel()
    hist = torch.zeros(_BINS, dtype=torch.int32, device=x.device)
    grid = grid_for(-(-n // _TILE_ITEMS), x.device)  # a tile per block and round
    args = (as_cupy(x), np.int64(n), as_cupy(hist))
    launch(_fn(f"mag_histogram<{C_TYPES[x.dtype]}>"), grid, BLOCK_THREADS, args)
    found = torch.empty(3, dtype=torch.int64, device=x.device)
    launch(_fn("find_bin"), 1, _FIND_THREADS, (as_cupy(hist), np.int64(k), as_cupy(found)))
    bin_ = int(found[0])
    return bin_ << _KEY_SHIFT, ((bin_ + 1) << _KEY_SHIFT) - 1


def topk_indices(x: Tensor, k: int) -> Tensor:
    """int64 indices of the ``k`` largest ``|x|`` of 1-D CUDA ``x`` (``0 < k < x.numel()``).

    The elements above the candidate key range come first, ascending, then the chosen
    candidates. Large inputs take the range from a sample; when the sample misleads (the counts
    show the k-th largest outside the range) or the input is small, from the histogram.
    """
    x = x.contiguous()
    with torch_stream(x.device):
        found = None
        if x.numel() > _SAMPLE:
            keys = _sampled_keys(x, k)
            offsets, (above, n_candidates) = _compact(x, "topk", keys=keys)
            if above < k <= above + n_candidates:
                found = keys, offsets, above, n_candidates
        if found is None:
            keys = _histogram_keys(x, k)
            offsets, (above, n_candidates) = _compact(x, "topk", keys=keys)
            found = keys, offsets, above, n_candidates
        keys, offsets, above, n_candidates = found
        out = torch.empty(k, dtype=torch.int64, device=x.device)
        candidates = torch.empty(n_candidates, dtype=torch.int64, device=x.device)
        _write(x, "topk", offsets, out, candidates, keys=keys)
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
        offsets, (total, _) = _compact(x, "threshold", threshold=threshold)
        out = torch.empty(total, dtype=torch.int64, device=x.device)
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
