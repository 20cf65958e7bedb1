"""Kernel backend selection (docs/design.md section 13).

Each hot operation has a vectorised torch implementation that runs on any device, the reference
its CuPy kernel (if any) is tested against. ``backend=None`` picks CuPy for a CUDA tensor when
CuPy is installed and a kernel exists for the call, torch otherwise; an explicitly requested
backend that cannot run raises instead of falling back silently (as torch's ``foreach``/``fused``
flags do).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Backend", "available_backends", "check_backend_name", "resolve_backend"]

Backend = Literal["torch", "cupy"]
_BACKENDS: tuple[Backend, ...] = ("torch", "cupy")


@functools.cache
def _cupy_usable() -> bool:
    return importlib.util.find_spec("cupy") is not None and torch.cuda.is_available()


def available_backends() -> list[Backend]:
    """Backends usable on this machine, best first."""
    found: list[Backend] = ["cupy"] if _cupy_usable() else []
    return [*found, "torch"]


def check_backend_name(backend: str | None) -> str | None:
    """Validate a backend option at construction time; returns it unchanged.

    Raises:
        ValueError: ``backend`` is neither ``None`` nor a known backend name.
    """
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {list(_BACKENDS)} or None, got {backend!r}")
    return backend


def resolve_backend(x: Tensor, backend: str | None, *, op: str, cupy: bool = False) -> Backend:
    """The backend to run operation ``op`` on ``x`` with.

    Args:
        x: the operation's main input (its device decides).
        backend: ``None`` (the best available), ``"torch"`` or ``"cupy"``.
        op: the operation's name, for error messages.
        cupy: whether a CuPy kernel exists for this call (the operation and ``x``'s dtype).

    Raises:
        ValueError: ``backend`` is not a known name.
        RuntimeError: ``backend`` is ``"cupy"`` but CuPy or CUDA is missing, ``x`` is not on a
            CUDA device, or there is no CuPy kernel for this call.
    """
    if check_backend_name(backend) == "torch":
        return "torch"
    if backend is None:
        return "cupy" if cupy and x.device.type == "cuda" and _cupy_usable() else "torch"
    if not _cupy_usable():
        raise RuntimeError("backend 'cupy' was requested but CuPy or CUDA is not available")
    if x.device.type != "cuda":
        raise RuntimeError(f"backend 'cupy' needs a CUDA tensor, got one on {x.device}")
    if not cupy:
        raise RuntimeError(f"backend 'cupy' has no kernel for {op} on {x.dtype} tensors")
    return "cupy"
