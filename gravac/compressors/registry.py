"""Name -> compressor class registry; the CLI, the optimizer and the tests read it."""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from gravac.compressors.base import Compressor

__all__ = ["create", "get", "names", "options", "register"]

_REGISTRY: dict[str, type[Compressor]] = {}

C = TypeVar("C", bound=type[Compressor])


def register(cls: C) -> C:
    """Class decorator: make ``cls`` available as ``create(cls.name)``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"compressor name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Registered compressor names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type[Compressor]:
    """The class registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; choose one of {names()}") from None


def options(name: str) -> list[str]:
    """Keyword options accepted by compressor ``name``."""
    params = inspect.signature(get(name).__init__).parameters
    return [p for p in params if p != "self" and params[p].kind is inspect.Parameter.KEYWORD_ONLY]


def create(name: str, **opts: Any) -> Compressor:
    """Build compressor ``name`` with keyword options ``opts``.

    Raises:
        ValueError: unknown name, unknown option, or an option value out of range.
    """
    allowed = options(name)
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(
            f"compressor {name!r} has no option {unknown[0]!r}; allowed options: {allowed}"
        )
    return get(name)(**opts)
