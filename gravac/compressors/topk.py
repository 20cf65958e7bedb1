"""Top-k sparsification (Aji and Heafield 2017; Stich et al., "Sparsified SGD with memory", 2018).

Keeps the ``k = round(d / CF)`` entries of largest magnitude, exactly, and sends their values and
flat indices through an all-gather. Multi-level compression is exact: the top-k2 of the top-k1
entries are the top-k2 of the input for k2 <= k1 (ties aside).
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from gravac.compressors.base import Round
from gravac.compressors.registry import register
from gravac.compressors.sparse import SparseCompressor
from gravac.kernels import check_backend_name, topk_indices

__all__ = ["TopKCompressor"]


@register
class TopKCompressor(SparseCompressor):
    """Exact Top-k by magnitude.

    Args:
        backend: kernel backend (``None`` picks the best available; see :mod:`gravac.kernels`).
    """

    name: ClassVar[str] = "topk"

    def __init__(self, *, backend: str | None = None) -> None:
        self.backend = check_backend_name(backend)

    def select(self, values: Tensor, k: int, rnd: Round) -> Tensor:
        return topk_indices(values, k, backend=self.backend)

    def __repr__(self) -> str:
        return f"TopKCompressor(backend={self.backend!r})"
