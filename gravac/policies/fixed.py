"""A static CF: the baseline every adaptive policy is compared with.

The optimizer sends at ``cf`` on every step, with no search and no fallback; gains are still
measured and logged, so a static run shows what the adaptive policies would have seen.
"""

from __future__ import annotations

from typing import ClassVar

from gravac.compressors.base import check_cf
from gravac.policies.base import ScalingPolicy, register

__all__ = ["FixedPolicy"]


@register
class FixedPolicy(ScalingPolicy):
    """Always send at ``cf`` (1 = dense)."""

    name: ClassVar[str] = "fixed"

    def __init__(self, *, cf: float) -> None:
        self.static_cf = check_cf(cf, name="fixed policy option cf")

    def first(self) -> float:
        return 1.0

    def next(self, s: float, window: int) -> float:
        return s
