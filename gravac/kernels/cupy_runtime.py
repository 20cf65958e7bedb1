"""Running gravac's CUDA kernels (``gravac/kernels/cuda/*.cu``) through CuPy.

* Compilation: each source is prefixed with ``common.cuh`` and compiled once per process by
  NVRTC (:class:`cupy.RawModule`, which also caches the binary on disk), with every template
  instantiation its Python wrapper launches named up front.
* Zero copy: :func:`as_cupy` wraps a tensor's memory in a CuPy array that holds a reference to
  the tensor (``cupy.cuda.UnownedMemory``); 16-bit floats as int16, since the kernels read their
  bit patterns. DLPack (:func:`as_cupy_dlpack`, ``cupy.from_dlpack``) gives the same view but
  costs about 22 us of host time per tensor on an H200 with torch 2.11 and CuPy 14 (its stream
  handshake; ``scripts/gpu_profile.py``), and a call passes up to eight tensors to kernels that
  run for 70-340 us at 64M elements: switching to these views took ``gravac bench kernels``'
  top-k from 1.38 to 0.80 ms and the fp16 cast from 0.22 to 0.18 ms. The ordering the
  handshake provides is already guaranteed, because every kernel runs on torch's current
  stream, where the tensors were produced.
* Ordering: kernels are launched on torch's current stream (:func:`torch_stream`), so they are
  ordered with the torch work around them exactly as a torch kernel would be; outputs are
  allocated by torch's caching allocator.

CuPy is imported on first use only: importing :mod:`gravac.kernels` never needs it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BLOCK_THREADS",
    "C_TYPES",
    "FLOAT_DTYPES",
    "as_cupy",
    "as_cupy_dlpack",
    "grid_for",
    "kernel",
    "launch",
    "torch_stream",
]

#: C names of the tensor dtypes the kernels take (16-bit floats travel as their bit patterns).
C_TYPES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "half_t",
    torch.bfloat16: "bf16_t",
    torch.uint8: "unsigned char",
    torch.int32: "int",
    torch.int64: "long long",
}
#: Floating-point dtypes every value-reading kernel is instantiated for.
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: Threads per block of the grid-stride kernels.
BLOCK_THREADS = 256
#: Blocks per multiprocessor of a grid-stride launch: enough resident warps to hide latency.
_BLOCKS_PER_SM = 8
_SOURCES = Path(__file__).parent / "cuda"
_PRELUDE = "common.cuh"
_NVRTC_OPTIONS = ("--std=c++17",)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
#: NumPy dtypes of the views (16-bit floats are viewed as int16 first).
_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int16: np.int16,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
}


def _cupy() -> Any:
    import cupy

    return cupy


@functools.cache
def _module(source: str, expressions: tuple[str, ...]) -> Any:
    code = (_SOURCES / _PRELUDE).read_text() + "\n" + (_SOURCES / source).read_text()
    return _cupy().RawModule(code=code, options=_NVRTC_OPTIONS, name_expressions=expressions)


def kernel(source: str, expressions: tuple[str, ...], name: str) -> Any:
    """The compiled kernel ``name`` (one of ``expressions``) of ``cuda/<source>``."""
    return _module(source, expressions).get_function(name)


def launch(fn: Any, grid: int, threads: int, args: tuple[Any, ...], *, shared_mem: int = 0) -> None:
    """Launch ``fn`` on ``grid`` blocks of ``threads`` (nothing for an empty grid)."""
    if grid > 0:
        fn((grid,), (threads,), args, shared_mem=shared_mem)


@functools.cache
def _external(pointer: int, index: int) -> tuple[Any, Any]:
    """CuPy's device and stream objects for a torch stream, made once per stream."""
    cp = _cupy()
    return cp.cuda.Device(index), cp.cuda.ExternalStream(pointer, index)


@contextlib.contextmanager
def torch_stream(device: torch.device) -> Iterator[None]:
    """Make torch's current stream on ``device`` CuPy's current stream and device."""
    stream = torch.cuda.current_stream(device)
    cp_device, cp_stream = _external(stream.cuda_stream, stream.device_index)
    with cp_device, cp_stream:
        yield


def _viewable(t: Tensor) -> Tensor:
    if not t.is_contiguous():
        raise ValueError("the CuPy kernels need contiguous tensors")
    return t.view(torch.int16) if t.dtype in _HALF_DTYPES else t


def as_cupy(t: Tensor) -> Any:
    """A CuPy view of contiguous CUDA tensor ``t`` (no copy, keeps ``t`` alive); 16-bit floats
    as int16. For use inside :func:`torch_stream` (the view carries no stream handshake)."""
    t = _viewable(t)
    if t.numel() == 0:
        return as_cupy_dlpack(t)
    cp = _cupy()
    nbytes = t.numel() * t.element_size()
    memory = cp.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index)
    return cp.ndarray((t.numel(),), _NUMPY[t.dtype], cp.cuda.MemoryPointer(memory, 0))


def as_cupy_dlpack(t: Tensor) -> Any:
    """:func:`as_cupy` through DLPack (``cupy.from_dlpack``, with its stream handshake)."""
    return _cupy().from_dlpack(_viewable(t))


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def grid_for(n: int, device: torch.device) -> int:
    """Blocks of a grid-stride launch over ``n`` elements: enough to fill ``device``, no more."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    need = -(-n // BLOCK_THREADS)
    return max(1, min(need, _multiprocessors(index) * _BLOCKS_PER_SM))
