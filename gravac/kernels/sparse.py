"""Sparse selection and aggregation kernels: top-k, threshold select, scatter-add.

Torch implementations, vectorised, on any device, and CuPy kernels for CUDA tensors
(:mod:`gravac.kernels.cupy_sparse`); see :mod:`gravac.kernels.backend`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gravac.kernels import cupy_sparse
from gravac.kernels.backend import resolve_backend

__all__ = [
    "MagnitudeScan",
    "index_dtype",
    "magnitude_scan",
    "scatter_add",
    "threshold_indices",
    "threshold_indices_reference",
    "topk_among",
    "topk_indices",
    "topk_indices_reference",
]

#: Flat indices fit int32 (half the wire bytes of int64) below this many elements.
_INT32_LIMIT = 2**31 - 1
#: The threshold path pays off when at most this fraction of the elements is kept (above it,
#: the survivors are most of the input and a selection among them costs as much as over all).
_THRESHOLD_MAX_FRACTION = 1 / 8
#: Below this many elements the threshold path's fixed costs (a sample, a loop over chunks) do
#: not pay: ``torch.topk`` is as fast (one CPU thread, ``benchmarks/topk_paths.py``: the two
#: even at 2^15 elements, the threshold 1.1 to 3 times faster from 3 x 2^14 elements on).
_THRESHOLD_MIN_NUMEL = 2**15
#: Below this many elements ``torch.topk`` is faster than NumPy's ``argpartition`` at every k
#: (3 to 4 times from 2^13 to 2^15 elements on one CPU thread, ``benchmarks/topk_paths.py``): the
#: exact selection where the threshold declines goes to it there.
_PARTITION_MIN_NUMEL = 2**16
#: The sample's stride: a prime, so that the sample does not run down one column of a matrix
#: whose rows have a power-of-two length; 1 in 257 costs about 1/20 of a pass over the input.
_SAMPLE_STRIDE = 257
#: Standard deviations of margin in the sampled threshold. The number of sampled elements above
#: the true k-th magnitude is binomial with mean ``m = s k / n`` (s sampled) and spread about
#: ``sqrt(m)``; taking the threshold at the ``m + Z sqrt(m)``-th largest sample leaves fewer than
#: k survivors (and the slow fallback) with probability below 1e-9 at Z = 6, for about
#: ``k (1 + Z / sqrt(m))`` survivors (1.24 k for 16M elements at CF 100).
_SURVIVOR_SIGMAS = 6.0
#: Elements per chunk of the threshold pass: the magnitude and mask work buffers stay in cache.
_CHUNK = 2**18
#: dtypes the NumPy threshold pass reads in place (bfloat16 has no NumPy dtype).
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


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
    chosen = _topk_by_threshold(x, k)
    if chosen is None and n >= _PARTITION_MIN_NUMEL:
        chosen = _topk_by_partition(x, k)
    return topk_indices_reference(x, k) if chosen is None else chosen


def topk_among(x: Tensor, candidates: Tensor, k: int, *, backend: str | None = None) -> Tensor:
    """Positions in 1-D ``x`` of the ``k`` largest magnitudes among ``x[candidates]`` (int64
    positions, at least ``k``): the exact top-k of ``x`` when the candidates hold every element
    at or above some threshold that at least ``k`` reach."""
    if candidates.numel() == k:
        return candidates
    among = topk_indices(x.index_select(0, candidates), k, backend=backend)
    return candidates.index_select(0, among)


def _topk_by_partition(x: Tensor, k: int) -> Tensor | None:
    """Exact top-k of a CPU tensor by NumPy's introselect (``argpartition``), five times
    ``torch.topk`` on one thread when k is a large part of the input; NaN and +-Inf partition
    above every finite magnitude, as the reference ranks them. ``None`` if NumPy cannot read
    ``x`` in place."""
    xn = _numpy_view(x)
    if xn is None or k == 0:
        return None
    return torch.from_numpy(np.argpartition(np.abs(xn), xn.size - k)[xn.size - k :])


def topk_indices_reference(x: Tensor, k: int) -> Tensor:
    """:func:`topk_indices` by ``torch.topk`` over every magnitude: the reference."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    mag = x.abs()
    if not x.is_floating_point() or mag.dtype in (torch.float16, torch.bfloat16):
        mag = mag.float()
    return torch.topk(mag, k, sorted=False).indices


def _topk_by_threshold(x: Tensor, k: int) -> Tensor | None:
    """Exact top-k through a sampled threshold on the CPU: the survivors of
    :func:`magnitude_scan` (a superset of the k largest), then an exact partial sort among
    those few; ``None`` (use the reference) when the scan is not possible.

    The partial sort ranks NaN and +-Inf above every finite magnitude (the scan keeps NaN), so
    they are selected first, as by the reference. Cost on one CPU thread at 16M float32
    elements, CF 100: about three copies of the input.
    """
    scan = magnitude_scan(x, k, stats=False)
    if scan is None:
        return None
    survivors = scan.indices.numpy()
    top = np.argpartition(scan.magnitudes.numpy(), survivors.size - k)
    return torch.from_numpy(survivors[top[survivors.size - k :]])


@dataclass(frozen=True)
class MagnitudeScan:
    """What :func:`magnitude_scan` found in one pass over ``|x|``.

    Attributes:
        indices: int64 positions, ascending, of every element whose magnitude is not below
            ``threshold`` (NaN included): at least the ``count`` asked for.
        magnitudes: ``|x|`` at ``indices`` (``x``'s dtype).
        threshold: the sampled threshold.
        mean, peak: ``mean |x|`` and ``max |x|`` (NaN if not asked for; non-finite values
            propagate).
    """

    indices: Tensor
    magnitudes: Tensor
    threshold: float
    mean: float
    peak: float


def magnitude_scan(x: Tensor, count: int, *, stats: bool = True) -> MagnitudeScan | None:
    """Every element of 1-D CPU ``x`` at or above a threshold sampled so that at least ``count``
    of them (a superset of the ``count`` largest magnitudes) pass, in one chunked pass that also
    sums and maxes ``|x|`` when ``stats``.

    The threshold ``t`` is the ``m + Z sqrt(m)``-th largest of a strided sample of ``|x|``, with
    ``m = s count / n`` the expected number of sampled elements among the ``count`` largest
    (:data:`_SURVIVOR_SIGMAS`): about ``count (1 + Z / sqrt(m))`` elements pass. Comparing
    ``not |x| < t`` keeps NaN among them. The pass runs in NumPy on a zero-copy view: its
    comparison and compaction (``flatnonzero``) are three times torch's on one CPU thread,
    where torch writes boolean masks slowly and compacts them elementwise.

    Returns ``None`` when fewer than ``count`` pass (a sample far from typical), when the
    sample gives no finite positive threshold (mostly zeros, or non-finite), when ``count`` is
    not below :data:`_THRESHOLD_MAX_FRACTION` of the elements or ``x`` is small (the caller's
    exact path is as fast), or when ``x`` is not a contiguous CPU tensor NumPy can read.
    """
    n = x.numel()
    if n < _THRESHOLD_MIN_NUMEL or not 0 < count <= n * _THRESHOLD_MAX_FRACTION:
        return None
    xn = _numpy_view(x)
    if xn is None:
        return None
    sample = np.abs(xn[::_SAMPLE_STRIDE])
    expected = sample.size * count / n
    want = math.ceil(expected + _SURVIVOR_SIGMAS * math.sqrt(expected))
    if want >= sample.size:
        return None
    t = sample[np.argpartition(sample, sample.size - want)[sample.size - want]]
    if not (np.isfinite(t) and t > 0):  # mostly zeros, or non-finite: no threshold separates
        return None
    survivors, mags, total, peak = _select_chunks(xn, float(t), keep_nan=True, stats=stats)
    if survivors.size < count:
        return None
    indices, magnitudes = torch.from_numpy(survivors), torch.from_numpy(mags)
    return MagnitudeScan(indices, magnitudes, float(t), total / n, peak)


def _numpy_view(x: Tensor) -> np.ndarray | None:
    """A zero-copy NumPy view of 1-D ``x``, if it is a contiguous CPU tensor of a NumPy dtype."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or not x.is_contiguous():
        return None
    return x.detach().reshape(-1).numpy()


def _select_chunks(
    xn: np.ndarray, t: float, *, keep_nan: bool, stats: bool
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Positions (int64, ascending) and magnitudes of the elements with ``|x| >= t``, or with
    ``not |x| < t`` (NaN included) if ``keep_nan``; with ``sum |x|`` and ``max |x|`` if
    ``stats`` (NaN if not).

    One pass in chunks of :data:`_CHUNK`, so that the magnitudes and the mask stay in cache
    (the selected magnitudes are taken from there, not gathered from memory afterwards);
    NumPy's comparison and compaction (``flatnonzero``) are three times torch's on one CPU
    thread, where torch writes boolean masks slowly and compacts them elementwise.
    """
    mag = np.empty(min(xn.size, _CHUNK), dtype=xn.dtype)
    mask = np.empty(mag.size, dtype=np.bool_)
    ones = np.ones(mag.size if stats else 0, dtype=xn.dtype)  # sum |x| as a BLAS dot product
    parts, taken = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=xn.dtype)]
    sums, peaks = [], []
    for start in range(0, xn.size, _CHUNK):
        m = min(_CHUNK, xn.size - start)
        np.abs(xn[start : start + m], out=mag[:m])
        if stats:
            with np.errstate(over="ignore"):  # an overflowing sum is inf: the caller sees it
                sums.append(float(mag[:m].dot(ones[:m])))
            peaks.append(mag[:m].max())
        if keep_nan:
            np.logical_not(np.less(mag[:m], t, out=mask[:m]), out=mask[:m])
        else:
            np.greater_equal(mag[:m], t, out=mask[:m])
        local = np.flatnonzero(mask[:m]).astype(np.int64, copy=False)
        taken.append(mag[:m].take(local))
        parts.append(np.add(local, start, out=local))
    total, peak = (sum(sums), float(np.max(peaks))) if stats and peaks else (math.nan, math.nan)
    return np.concatenate(parts), np.concatenate(taken), total, peak


def threshold_indices(x: Tensor, threshold: float, *, backend: str | None = None) -> Tensor:
    """Flat int64 indices of the entries of 1-D ``x`` with ``|x| >= threshold``, ascending
    (one chunked NumPy pass on the CPU, see :func:`_select_chunks`)."""
    if resolve_backend(x, backend, op="threshold", cupy=cupy_sparse.supports(x)) == "cupy":
        return cupy_sparse.threshold_indices(x, threshold)
    xn = _numpy_view(x)
    if xn is None:
        return threshold_indices_reference(x, threshold)
    positions = _select_chunks(xn, threshold, keep_nan=False, stats=False)[0]
    return torch.from_numpy(positions)


def threshold_indices_reference(x: Tensor, threshold: float) -> Tensor:
    """:func:`threshold_indices` by ``torch.nonzero`` over every magnitude: the reference."""
    return torch.nonzero(x.abs() >= threshold).reshape(-1)


def scatter_add(
    numel: int,
    indices: Tensor,
    values: Tensor,
    *,
    backend: str | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Dense 1-D tensor of ``numel`` zeros with ``values`` added at ``indices`` (sums repeats);
    written into ``out`` (flat, ``numel`` elements of ``values``' dtype) when given."""
    cupy = cupy_sparse.supports(values)
    if resolve_backend(values, backend, op="scatter_add", cupy=cupy) == "cupy":
        dense = cupy_sparse.scatter_add(numel, indices, values)
        return dense if out is None else out.copy_(dense)
    out = torch.zeros(numel, dtype=values.dtype, device=values.device) if out is None else out
    return out.zero_().index_add_(0, indices.reshape(-1), values.reshape(-1))  # int32 or int64
