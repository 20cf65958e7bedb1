"""Kernel backend selection (DESIGN.md section 8).

Each hot operation has a vectorised torch implementation that runs on any device. ``backend=None``
picks the best available implementation for the tensor; an explicitly requested backend that is
not available raises instead of falling back silently (as torch's ``foreach``/``fused`` flags do).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from torch import Tensor

__all__ = ["Backend", "available_backends", "check_backend_name", "resolve_backend"]

Backend = Literal["torch", "cupy"]
_BACKENDS: tuple[Backend, ...] = ("torch", "cupy")


def _cupy_usable() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    import torch

    return torch.cuda.is_available()


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


def resolve_backend(x: Tensor, backend: str | None) -> Backend:
    """The backend to run an operation on ``x`` with.

    Raises:
        ValueError: ``backend`` is not a known name.
        RuntimeError: ``backend`` is known but cannot run on this machine or on ``x``'s device.
    """
    if check_backend_name(backend) is None:
        return "torch"
    if backend == "cupy":
        if not _cupy_usable():
            raise RuntimeError("backend 'cupy' was requested but CuPy or CUDA is not available")
        if x.device.type != "cuda":
            raise RuntimeError(f"backend 'cupy' needs a CUDA tensor, got one on {x.device}")
        raise RuntimeError("backend 'cupy' has no kernel for this operation yet")
    return "torch"
