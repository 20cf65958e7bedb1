"""Name -> compressor class registry; the CLI, the optimizer and the tests read it."""

from __future__ import annotations

from typing import Any, TypeVar

from gravac.compressors.base import Compressor
from gravac.registry import Registry

__all__ = ["create", "get", "names", "options", "register"]

_REGISTRY: Registry[Compressor] = Registry("compressor")

C = TypeVar("C", bound=type[Compressor])


def register(cls: C) -> C:
    """Class decorator: make ``cls`` available as ``create(cls.name)``."""
    _REGISTRY.register(cls)
    return cls


def names() -> list[str]:
    """Registered compressor names, sorted."""
    return _REGISTRY.names()


def get(name: str) -> type[Compressor]:
    """The class registered as ``name``."""
    return _REGISTRY.get(name)


def options(name: str) -> list[str]:
    """Keyword options accepted by compressor ``name``."""
    return _REGISTRY.options(name)


def create(name: str, **opts: Any) -> Compressor:
    """Build compressor ``name`` with keyword options ``opts``.

    Raises:
        ValueError: unknown name, unknown option, or an option value out of range.
    """
    return _REGISTRY.create(name, **opts)
