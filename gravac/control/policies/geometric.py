"""Geometric scaling (GraVAC section IV-B): ``s <- s * r`` after every search window.

Candidates form a geometric progression ``theta_min * r, theta_min * r^2, ...``: a smooth search
that evaluates many intermediate CFs.
"""

from __future__ import annotations

import math
from typing import ClassVar

from gravac.control.policies.base import ScalingPolicy, register

__all__ = ["GeometricPolicy", "RatioPolicy"]

#: default ratio: the candidate CF doubles every window
DEFAULT_RATIO = 2.0


def check_ratio(ratio: float, policy: str) -> float:
    """A growth ratio must be a finite number > 1."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not math.isfinite(ratio):
        raise ValueError(f"{policy} policy option ratio must be a finite number > 1, got {ratio!r}")
    if ratio <= 1:
        raise ValueError(f"{policy} policy option ratio must be > 1, got {ratio!r}")
    return float(ratio)


class RatioPolicy(ScalingPolicy):
    """A ladder whose step size grows by a ratio ``r`` (``s_1 = r``; :meth:`next`: how)."""

    def __init__(self, *, ratio: float = DEFAULT_RATIO) -> None:
        self.ratio = check_ratio(ratio, self.name)

    def first(self) -> float:
        return self.ratio


@register
class GeometricPolicy(RatioPolicy):
    """``s_1 = r``; ``s_{j+1} = s_j * r``; the options of :class:`RatioPolicy`."""

    name: ClassVar[str] = "geometric"

    def next(self, s: float, window: int) -> float:
        return s * self.ratio
