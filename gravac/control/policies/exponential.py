"""Exponential scaling (GraVAC section IV-B): the growth itself grows.

``s_1 = r`` and ``s_{j+1} = s_j * r^j`` after the ``j``-th window, i.e. ``s_j = r^(j(j+1)/2)``:
with ``r = 2`` the candidates are ``theta_min`` times 2, 8, 64, 1024, ...; the search reaches
``theta_max`` in far fewer windows than the geometric policy, at the price of skipping
intermediate CFs (the fallback to ``theta_min`` and the throughput table still guard it).
"""

from __future__ import annotations

from typing import ClassVar

from gravac.control.policies.base import register
from gravac.control.policies.geometric import RatioPolicy

__all__ = ["ExponentialPolicy"]


@register
class ExponentialPolicy(RatioPolicy):
    """``s_1 = r``; ``s_{j+1} = s_j * r^j``; the options of
    :class:`gravac.control.policies.geometric.RatioPolicy`."""

    name: ClassVar[str] = "exponential"

    def next(self, s: float, window: int) -> float:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        return s * self.ratio**window
