"""RedSync's trimmed top-k selection (Fang, Fu, Ge, Song, Chen and Mao, "RedSync: Reducing
synchronization bandwidth for distributed deep learning training system", JPDC 2019).

RedSync avoids a full top-k by searching a magnitude threshold between the mean and the maximum
absolute value::

    thr(r) = mean|x| + r (max|x| - mean|x|),   r in [0, 1]

``nnz(r) = #{i: |x_i| >= thr(r)}`` decreases with ``r``; a binary search on ``r`` (at most
``_MAX_SEARCH_ITERS`` halvings of the interval) stops at the first ``r`` with ``k <= nnz < 2k``.
The exact top-k of that selection is sent, so every payload holds exactly ``k`` values and
indices for the all-gather; since the selection holds every entry at or above the threshold, this
is the exact top-k of the input (ties aside) at the cost of a few threshold passes plus a top-k
over fewer than ``2k`` entries.

If the search does not land in ``[k, 2k)`` (e.g. all magnitudes equal, where ``thr`` does not
depend on ``r``, or heavy tails narrower than the search's resolution), or the input is not
finite, the exact top-k is taken over the smallest selection of at least ``k`` entries seen (all
values if none) and :attr:`RedSyncCompressor.fallbacks` is incremented.

.. note:: The paper also quantizes the sent values; the public code found sends raw values, and
   so does this module (docs/design.md section 10).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from gravac.compressors.base import Round
from gravac.compressors.registry import register
from gravac.compressors.sparse import SparseCompressor
from gravac.kernels import check_backend_name, threshold_indices, topk_indices
from gravac.kernels.sparse import magnitude_scan, topk_among

__all__ = ["RedSyncCompressor", "redsync_threshold"]

#: Halvings of the search interval for r: resolution 2^-16 of (max - mean), enough for the heavy
#: tails of real gradients; each iteration is one threshold pass over the tensor.
_MAX_SEARCH_ITERS = 16
#: The search accepts ``k <= nnz < _ACCEPT_FACTOR * k`` (the paper's window).
_ACCEPT_FACTOR = 2


def redsync_threshold(mean: float, peak: float, r: float) -> float:
    """``thr(r) = mean + r (peak - mean)`` for ``mean = mean|x|`` and ``peak = max|x|``."""
    return mean + r * (peak - mean)


@register
class RedSyncCompressor(SparseCompressor):
    """RedSync: threshold ``mean + r (max - mean)`` by binary search on r, then exactly k.

    Args:
        backend: kernel backend (``None`` picks the best available; see :mod:`gravac.kernels`).

    Attributes:
        fallbacks: selections whose search failed and used the exact top-k path (diagnostics).
        searches: threshold passes made by the binary searches so far (diagnostics).
    """

    name: ClassVar[str] = "redsync"

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = check_backend_name(backend)
        self.fallbacks = 0
        self.searches = 0

    def select(self, values: Tensor, k: int, rnd: Round) -> Tensor:
        pool = _Pool.of(values, _ACCEPT_FACTOR * k, self.backend)
        best: float | None = None  # the threshold of the smallest selection of >= k seen
        best_nnz = 0
        if math.isfinite(pool.mean) and math.isfinite(pool.peak):  # else: exact top-k
            lo, hi = 0.0, 1.0
            # All magnitudes equal: thr(r) is the same for every r, one pass decides.
            r, iters = (0.0, 1) if pool.peak <= pool.mean else (0.5, _MAX_SEARCH_ITERS)
            at_peak: int | None = None
            for _ in range(iters):
                self.searches += 1
                thr = redsync_threshold(pool.mean, pool.peak, r)
                nnz = pool.count(thr)
                if nnz is not None and k <= nnz < _ACCEPT_FACTOR * k:
                    return pool.top(thr, k)
                if nnz is not None and nnz < k:
                    hi = r
                else:
                    lo = r
                    if nnz is not None and (best is None or nnz < best_nnz):
                        best, best_nnz = thr, nnz
                    if at_peak is None:
                        at_peak = pool.at_peak()
                    # Everything selected ties at the maximum: no threshold selects fewer.
                    if nnz is not None and nnz == at_peak:
                        break
                r = (lo + hi) / 2
        self.fallbacks += 1
        return pool.top(best, k)

    def __repr__(self) -> str:
        return f"RedSyncCompressor(backend={self.backend!r})"


@dataclass(frozen=True)
class _Pool:
    """Where the search counts: the survivors of one :func:`magnitude_scan` (a superset of
    the ``2k`` largest, with ``mean |x|`` and ``max |x|`` from the same pass) on the CPU, or
    every element otherwise. Thresholds below the scan's ``floor`` select at least the whole
    pool, ``>= 2k`` elements, so they need no count: the binary search visits the same ``r``
    and ends with the same selection as with counts over everything.
    """

    values: Tensor
    mag: Tensor  # magnitudes of the pool's elements
    indices: Tensor | None  # their positions in ``values`` (None: every element)
    floor: float
    mean: float
    peak: float
    backend: str | None

    @staticmethod
    def of(values: Tensor, count: int, backend: str | None) -> _Pool:
        scan = magnitude_scan(values, count)
        if scan is not None:
            mag = scan.magnitudes
            return _Pool(values, mag, scan.indices, scan.threshold, scan.mean, scan.peak, backend)
        mag = values.abs()
        acc = torch.float64 if values.dtype == torch.float64 else torch.float32
        mean, peak = float(mag.mean(dtype=acc)), float(mag.max())
        return _Pool(values, mag, None, -math.inf, mean, peak, backend)

    def count(self, thr: float) -> int | None:
        """``#{i: |x_i| >= thr}``, or ``None`` when it is at least the pool (thr below floor)."""
        if thr < self.floor:
            return None
        return _count_at_least(self.mag, thr)

    def at_peak(self) -> int:
        """``#{i: |x_i| >= max |x|}`` (the pool holds every such element)."""
        return _count_at_least(self.mag, self.peak)

    def top(self, thr: float | None, k: int) -> Tensor:
        """int64 positions in ``values`` of the ``k`` largest magnitudes among the elements
        with ``|x| >= thr``; ``thr=None``: among the pool (a superset of the 2k largest), or
        among every element. The exact top-k of the input (ties aside) either way."""
        if self.indices is None:
            if thr is None:
                return topk_indices(self.values, k, backend=self.backend)
            chosen = threshold_indices(self.values, thr, backend=self.backend)
            return topk_among(self.values, chosen, k, backend=self.backend)
        sel = threshold_indices(self.mag, thr, backend=self.backend) if thr is not None else None
        mag = self.mag if sel is None else self.mag.index_select(0, sel)
        among = topk_indices(mag, k, backend=self.backend)
        return self.indices.index_select(0, among if sel is None else sel.index_select(0, among))


def _count_at_least(mag: Tensor, thr: float) -> int:
    """``#{i: mag_i >= thr}``; on the CPU through NumPy, whose boolean comparison is about three
    times torch's there (the search counts the pool some ten times a step)."""
    if mag.device.type == "cpu" and mag.dtype in (torch.float16, torch.float32, torch.float64):
        return int(np.count_nonzero(mag.numpy() >= thr))
    return int(torch.count_nonzero(mag >= thr))
