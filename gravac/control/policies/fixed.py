"""A static CF: the baseline every adaptive policy is compared with.

The optimizer sends at ``cf`` on every step, with no search and no fallback. Under error feedback
the window gain (:mod:`gravac.control.window`) is logged once a window; with ``measure=True`` each
step's gain is too, so a static run shows what the adaptive policies would have seen.
"""

from __future__ import annotations

from typing import ClassVar

from gravac.checks import check_cf
from gravac.control.policies.base import ScalingPolicy, register

__all__ = ["FixedPolicy"]


@register
class FixedPolicy(ScalingPolicy):
    """Always send at ``cf`` (1 = dense); ``measure``: compute each step's gain too (a cost
    the adaptive policies pay), to log what a search would see."""

    name: ClassVar[str] = "fixed"

    def __init__(self, *, cf: float, measure: bool = False) -> None:
        self.static_cf = check_cf(cf, name="fixed policy option cf")
        if not isinstance(measure, bool):
            raise ValueError(f"fixed policy option measure must be true or false, got {measure!r}")
        self.measure = measure

    def first(self) -> float:
        return 1.0

    def next(self, s: float, window: int) -> float:
        return s
