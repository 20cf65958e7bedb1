"""Hot operations of the compressors, dispatched by backend (docs/design.md section 13).

Torch implementations run on any device and are the references; CuPy kernels (``cuda/*.cu``,
wrapped by the ``cupy_*`` modules) run on CUDA tensors when CuPy is installed.
"""

from gravac.kernels.backend import (
    Backend,
    available_backends,
    check_backend_name,
    resolve_backend,
)
from gravac.kernels.cast import scaled_cast
from gravac.kernels.hadamard import fwht, is_power_of_two, next_power_of_two
from gravac.kernels.quantize import (
    PACK_BITS,
    hash_signs,
    hash_uniform,
    lookup,
    pack_bits,
    packed_numel,
    stochastic_quantize,
    table_cells,
    unpack_bits,
    unpack_lookup_sum,
)
from gravac.kernels.sparse import index_dtype, scatter_add, threshold_indices, topk_indices

__all__ = [
    "PACK_BITS",
    "Backend",
    "available_backends",
    "check_backend_name",
    "fwht",
    "hash_signs",
    "hash_uniform",
    "index_dtype",
    "is_power_of_two",
    "lookup",
    "next_power_of_two",
    "pack_bits",
    "packed_numel",
    "resolve_backend",
    "scaled_cast",
    "scatter_add",
    "stochastic_quantize",
    "table_cells",
    "threshold_indices",
    "topk_indices",
    "unpack_bits",
    "unpack_lookup_sum",
]
