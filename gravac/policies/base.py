"""The scaling-policy interface and registry (GraVAC section IV-B; DESIGN.md section 5).

A policy decides, from explicit state that the controller owns, how the candidate's step size
``s`` grows at the end of each search window (the candidate CF is ``min(theta_min * s,
theta_max)``). Policies are small, immutable objects: they checkpoint trivially and test without
fixtures. A policy with a :attr:`ScalingPolicy.static_cf` pins the CF instead (the baseline).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

__all__ = ["ScalingPolicy", "create", "get", "names", "register"]


class ScalingPolicy(ABC):
    """How the candidate CF scales between search windows."""

    name: ClassVar[str]
    #: a CF sent at every step, with no search; ``None`` for adaptive policies
    static_cf: float | None = None

    @abstractmethod
    def first(self) -> float:
        """The step size ``s`` of the first search window (> 1)."""

    @abstractmethod
    def next(self, s: float, window: int) -> float:
        """The step size after the ``window``-th search window (1-based) used step size ``s``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


_REGISTRY: dict[str, type[ScalingPolicy]] = {}
P = TypeVar("P", bound=type[ScalingPolicy])


def register(cls: P) -> P:
    """Class decorator: make ``cls`` available as ``create(cls.name)``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type[ScalingPolicy]:
    """The class registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {names()}") from None


def create(name: str, **options: Any) -> ScalingPolicy:
    """Build policy ``name`` with keyword ``options``; unknown names or options raise."""
    cls = get(name)
    params = inspect.signature(cls.__init__).parameters
    allowed = [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {unknown[0]!r}; allowed options: {allowed}"
        )
    missing = [
        p for p in allowed if params[p].default is inspect.Parameter.empty and p not in options
    ]
    if missing:
        raise ValueError(f"policy {name!r} needs option {missing[0]!r}")
    return cls(**options)
