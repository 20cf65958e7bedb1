"""Exponential scaling (GraVAC section IV-B): the growth itself grows.

``s_1 = r`` and ``s_{j+1} = s_j * r^j`` after the ``j``-th window, i.e. ``s_j = r^(j(j+1)/2)``:
with ``r = 2`` the candidates are ``theta_min`` times 2, 8, 64, 1024, ...; the search reaches
``theta_max`` in far fewer windows than the geometric policy, at the price of skipping
intermediate CFs (the fallback to ``theta_min`` and the throughput table still guard it).
"""

from __future__ import annotations

from typing import ClassVar

from gravac.policies.base import (
    ScalingPolicy,
    check_horizon,
    check_noise,
    check_progress,
    check_search,
    register,
)
from gravac.policies.geometric import DEFAULT_RATIO, check_ratio

__all__ = ["ExponentialPolicy"]


@register
class ExponentialPolicy(ScalingPolicy):
    """``s_1 = r``; ``s_{j+1} = s_j * r^j``; ``search``: :data:`gravac.policies.base.SEARCHES`;
    ``progress``: :func:`gravac.policies.base.check_progress`; ``horizon``:
    :func:`gravac.policies.base.check_horizon`; ``noise``:
    :func:`gravac.policies.base.check_noise`."""

    name: ClassVar[str] = "exponential"

    def __init__(
        self,
        *,
        ratio: float = DEFAULT_RATIO,
        search: str = "auto",
        progress: str | None = None,
        horizon: int | None = None,
        noise: bool | None = None,
    ) -> None:
        self.ratio = check_ratio(ratio, self.name)
        self.search = check_search(search, self.name)
        self.progress = check_progress(progress, self.search, self.name)
        self.horizon = check_horizon(horizon, self.search, self.name)
        self.noise = check_noise(noise, self.search, self.name)

    def first(self) -> float:
        return self.ratio

    def next(self, s: float, window: int) -> float:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        return s * self.ratio**window
