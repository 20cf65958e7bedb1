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
   so does this module (DESIGN.md 6).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from gravac.compressors.base import Round
from gravac.compressors.registry import register
from gravac.compressors.sparse import SparseCompressor
from gravac.kernels import check_backend_name, threshold_indices, topk_indices

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

    def _top_of(self, values: Tensor, chosen: Tensor, k: int) -> Tensor:
        if chosen.numel() == k:
            return chosen
        return chosen[topk_indices(values[chosen], k, backend=self.backend)]

    def select(self, values: Tensor, k: int, rnd: Round) -> Tensor:
        mag = values.abs()
        acc = torch.float64 if values.dtype == torch.float64 else torch.float32
        mean = float(mag.mean(dtype=acc))
        peak = float(mag.max())
        best: Tensor | None = None  # the smallest selection of at least k entries seen
        if math.isfinite(mean) and math.isfinite(peak):  # else: NaN/Inf, sent by exact top-k
            lo, hi = 0.0, 1.0
            # All magnitudes equal: thr(r) is the same for every r, one pass decides.
            r, iters = (0.0, 1) if peak <= mean else (0.5, _MAX_SEARCH_ITERS)
            for _ in range(iters):
                self.searches += 1
                thr = redsync_threshold(mean, peak, r)
                chosen = threshold_indices(values, thr, backend=self.backend)
                nnz = chosen.numel()
                if k <= nnz < _ACCEPT_FACTOR * k:
                    return self._top_of(values, chosen, k)
                if nnz < k:
                    hi = r
                else:
                    lo = r
                    if best is None or nnz < best.numel():
                        best = chosen
                    # Everything selected ties at the maximum: no threshold selects fewer.
                    if float(mag[chosen].min()) >= peak:
                        break
                r = (lo + hi) / 2
        self.fallbacks += 1
        if best is not None:
            return self._top_of(values, best, k)
        return topk_indices(values, k, backend=self.backend)

    def __repr__(self) -> str:
        return f"RedSyncCompressor(backend={self.backend!r})"
