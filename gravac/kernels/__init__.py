"""Hot operations of the compressors, dispatched by backend (DESIGN.md section 8)."""

from gravac.kernels.backend import (
    Backend,
    available_backends,
    check_backend_name,
    resolve_backend,
)
from gravac.kernels.sparse import index_dtype, scatter_add, threshold_indices, topk_indices

__all__ = [
    "Backend",
    "available_backends",
    "check_backend_name",
    "index_dtype",
    "resolve_backend",
    "scatter_add",
    "threshold_indices",
    "topk_indices",
]
