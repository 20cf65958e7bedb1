"""A name -> class registry with option checking, shared by compressors and policies.

Classes register under their ``name`` attribute; :meth:`Registry.create` builds one from
keyword-only options and rejects unknown names, unknown options and missing required options
with a ``ValueError`` that names the value and what is allowed.
"""

from __future__ import annotations

import inspect
from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes of one ``kind`` (e.g. ``"compressor"``) by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> None:
        """Make ``cls`` available under ``cls.name``."""
        name: str = cls.name  # type: ignore[attr-defined]
        if name in self._classes:
            raise ValueError(f"{self.kind} name {name!r} is registered twice")
        self._classes[name] = cls

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``."""
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {self.names()}"
            ) from None

    def options(self, name: str) -> list[str]:
        """Keyword-only options of ``name``'s constructor."""
        params = inspect.signature(self.get(name).__init__).parameters
        return [p for p in params if params[p].kind is inspect.Parameter.KEYWORD_ONLY]

    def create(self, name: str, **options: Any) -> T:
        """Build ``name`` with keyword ``options``."""
        params = inspect.signature(self.get(name).__init__).parameters
        allowed = self.options(name)
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} has no option {unknown[0]!r}; allowed options: {allowed}"
            )
        missing = [
            p for p in allowed if params[p].default is inspect.Parameter.empty and p not in options
        ]
        if missing:
            raise ValueError(f"{self.kind} {name!r} needs option {missing[0]!r}")
        return self.get(name)(**options)
