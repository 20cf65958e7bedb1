"""Checks of option values shared by the compressors, the controllers and the front ends.

Each raises ``ValueError`` naming the option, its value and what is allowed.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["check_cf", "is_integer", "is_real"]


def is_real(value: object) -> bool:
    """A real number, NumPy's included, but not a bool (``True`` is no CF or epsilon)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def is_integer(value: object) -> bool:
    """An integer, NumPy's included, but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def check_cf(cf: float, *, name: str = "cf") -> float:
    """Validate a compression factor: a finite number >= 1."""
    if not is_real(cf):
        raise ValueError(f"{name} must be a number >= 1, got {cf!r}")
    if not math.isfinite(cf) or cf < 1:
        raise ValueError(f"{name} must be a finite number >= 1, got {cf!r}")
    return float(cf)
