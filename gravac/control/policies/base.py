"""The ladder interface and registry (GraVAC section IV-B; docs/design.md section 9).

A ladder (a scaling policy, as the paper calls it) says which CFs a search climbs: from explicit
state that the search owns, how the candidate's step size ``s`` grows at the end of each search
window (the candidate CF is ``min(theta_min * s, theta_max)``). Ladders are small, immutable,
pure objects: they checkpoint trivially and test without fixtures; how a ladder's CFs are
judged is the search's (:class:`gravac.control.options.ControllerConfig`). A ladder with a
:attr:`ScalingPolicy.static_cf` pins the CF instead (the baseline).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

from gravac.registry import Registry

__all__ = [
    "ScalingPolicy",
    "create",
    "get",
    "names",
    "register",
]


class ScalingPolicy(ABC):
    """How the candidate CF scales between search windows."""

    name: ClassVar[str]
    #: a CF sent at every step, with no search; ``None`` for adaptive policies
    static_cf: float | None = None
    #: a static CF's first steps' CFs, ``(steps, cf)`` pairs sent in order before it
    static_warmup: tuple[tuple[int, float], ...] = ()
    #: a static CF's steps still measure their gain (for studies; adaptive policies always do)
    measure: bool = False

    @abstractmethod
    def first(self) -> float:
        """The step size ``s`` of the first search window (> 1)."""

    @abstractmethod
    def next(self, s: float, window: int) -> float:
        """The step size after the ``window``-th search window (1-based) used step size ``s``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


_REGISTRY: Registry[ScalingPolicy] = Registry("policy")
P = TypeVar("P", bound=type[ScalingPolicy])


def register(cls: P) -> P:
    """Class decorator: make ``cls`` available as ``create(cls.name)``."""
    _REGISTRY.register(cls)
    return cls


def names() -> list[str]:
    """Registered policy names, sorted."""
    return _REGISTRY.names()


def get(name: str) -> type[ScalingPolicy]:
    """The class registered as ``name``."""
    return _REGISTRY.get(name)


def create(name: str, **options: Any) -> ScalingPolicy:
    """Build policy ``name`` with keyword ``options``; unknown names or options raise."""
    return _REGISTRY.create(name, **options)
