"""CuPy kernels of THC (``cuda/thc.cu``): fused compression, and unpack + lookup + sum.

:func:`thc_encode` runs :func:`gravac.compressors.thc.thc_encode`'s whole pipeline (sign flip,
blocked Hadamard transform in shared memory, scale, clamp, hashed stochastic rounding, table
lookup, lane packing) in one pass, one CUDA block per rotation block of at most
:data:`MAX_SHARED_BLOCK` elements, bit-identical to the torch reference. Larger blocks (the full
rotation of a large tensor) arrive already rotated by torch and the kernel does the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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

__all__ = ["MAX_SHARED_BLOCK", "supports", "thc_encode", "unpack_lookup_sum"]

#: Largest rotation block transformed in shared memory: 4096 float64 (32 KiB) plus its 4 KiB of
#: indices stay under the 48 KiB a block may use without opting in.
MAX_SHARED_BLOCK = 4096
#: Threads per CUDA block of the generic fused kernel (fewer for smaller rotation blocks, at least
#: a warp).
_ENCODE_THREADS = 256
#: From this block length up, the register kernel: 4 elements a thread, a warp at least.
_FAST_MIN_BLOCK = 128
_FAST_ITEMS = 4
_WARP = 32
_BYTE_BITS = 8
_MASK32 = 0xFFFFFFFF
_SOURCE = "thc.cu"
_LANES = (torch.uint8, torch.int32, torch.int64)


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _name(kind: str, src: torch.dtype, out: torch.dtype, packed: bool) -> str:
    """``kind``: "rotated" (pre-rotated compute-dtype input), "block" or "fast"."""
    flag = str(packed).lower()
    if kind == "rotated":
        return f"thc_encode_rotated<{C_TYPES[src]},{C_TYPES[out]},{flag}>"
    c = C_TYPES[_compute(src)]
    return f"thc_encode_{kind}<{C_TYPES[src]},{c},{C_TYPES[out]},{flag}>"


_COMPUTE = (torch.float32, torch.float64)
_EXPRESSIONS = (
    "thc_unpack_sum",
    *(
        _name(kind, d, out, out == torch.uint8 and packed)
        for kind in ("block", "fast")
        for d in FLOAT_DTYPES
        for out, packed in [*((lane, False) for lane in _LANES), (torch.uint8, True)]
    ),
    *(_name("rotated", c, lane, False) for c in _COMPUTE for lane in _LANES),
    *(_name("rotated", c, torch.uint8, True) for c in _COMPUTE),
)


def supports(x: Tensor) -> bool:
    """Whether the fused kernel compresses ``x`` (a floating-point tensor)."""
    return x.dtype in FLOAT_DTYPES


def _seed_halves(seed: int) -> tuple[np.uint32, np.uint32]:
    return np.uint32(seed & _MASK32), np.uint32((seed >> 32) & _MASK32)


def thc_encode(
    x: Tensor,
    scale: Tensor,
    levels: Tensor,
    inv_width: Tensor,
    cell_index: Tensor,
    lane_table: Tensor | None,
    *,
    bounds: tuple[int, int],
    block: int,
    padded: int,
    clamp: float,
    granularity: int,
    sign_seed: int,
    round_seed: int,
    bits: int,
    rotated: bool,
) -> Tensor:
    """THC's payload tensor for flat CUDA ``x``.

    Args:
        x: the flat input (``rotated=False``), or its rotated, normalised, padded values in the
            compute dtype (``rotated=True``, for blocks above :data:`MAX_SHARED_BLOCK`).
        scale: ``sqrt(B) / l`` per block, in the compute dtype.
        levels, inv_width: :func:`gravac.kernels.quantize.table_intervals` of the table in the
            compute dtype, on ``x``'s device.
        cell_index: :func:`gravac.kernels.quantize.table_cells`' cell index, int32, on the device.
        bounds: the table's first and last levels.
        lane_table: the value sent for each table index, in the lane dtype (``T`` itself for the
            all-reduce transport; ``0..2^b - 1`` as uint8 for unpacked indices); ``None`` packs
            the indices ``8 / bits`` to a byte (needs ``block * bits`` to be a multiple of 8).
    """
    device = x.device
    cd = _compute(x.dtype)
    packed = lane_table is None
    if packed:
        out = torch.empty(padded * bits // _BYTE_BITS, dtype=torch.uint8, device=device)
    else:
        out = torch.empty(padded, dtype=lane_table.dtype, device=device)  # type: ignore[union-attr]
    if padded == 0:
        return out
    log_b = block.bit_length() - 1
    real = np.float64 if cd == torch.float64 else np.float32
    lo, hi = bounds
    table = lane_table if lane_table is not None else levels
    kind = "rotated" if rotated else ("fast" if block >= _FAST_MIN_BLOCK else "block")
    name = _name(kind, x.dtype, out.dtype, packed)
    head = (
        as_cupy(x.contiguous()),
        as_cupy(scale.to(cd).contiguous()),
        as_cupy(levels),
        as_cupy(inv_width),
        as_cupy(cell_index),
        as_cupy(out if packed else table),
        as_cupy(out),
        np.int64(x.numel()),
        np.int32(log_b),
    )
    quantize = (
        real(clamp),
        real(granularity / (2.0 * clamp)),
        real(granularity),
        np.int64(lo),
        np.int64(hi),
    )
    fn = kernel(_SOURCE, _EXPRESSIONS, name)
    with torch_stream(device):
        if rotated:
            tail = (*_seed_halves(round_seed), np.int32(bits))
            units = padded * bits // _BYTE_BITS if packed else padded
            launch(fn, grid_for(units, device), BLOCK_THREADS, (*head, *quantize, *tail))
        else:
            norm = real(math.pow(2.0, -log_b / 2.0))
            seeds = (*_seed_halves(sign_seed), *_seed_halves(round_seed))
            values = block * torch.finfo(cd).bits // _BYTE_BITS
            if kind == "fast":
                threads, shared = block // _FAST_ITEMS, values
            else:
                threads, shared = min(max(block, _WARP), _ENCODE_THREADS), values + block
            full = (*head, norm, *quantize, *seeds, np.int32(bits))
            launch(fn, padded // block, threads, full, shared_mem=shared)
    return out


def unpack_lookup_sum(packed: Sequence[Tensor], bits: int, numel: int, table: Tensor) -> Tensor:
    """``sum_r table[unpack(packed[r])]`` over ``numel`` elements, int64, on CUDA."""
    device = packed[0].device
    out = torch.empty(numel, dtype=torch.int64, device=device)
    if numel == 0:
        return out
    sources = [p.contiguous() for p in packed]
    pointers = torch.tensor([p.data_ptr() for p in sources], dtype=torch.int64, device=device)
    levels = table.to(device=device, dtype=torch.int64)
    args = (
        as_cupy(pointers),
        np.int32(len(sources)),
        np.int64(numel),
        np.int32(bits),
        as_cupy(levels),
        as_cupy(out),
    )
    with torch_stream(device):
        fn = kernel(_SOURCE, _EXPRESSIONS, "thc_unpack_sum")
        launch(fn, grid_for(numel, device), BLOCK_THREADS, args)
    return out
