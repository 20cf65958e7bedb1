"""What several searches share as plain functions: a ladder's candidates, the CF chosen among
those as good within omega, a saved CF's check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gravac.control.options import ControllerConfig
from gravac.control.policies.base import ScalingPolicy
from gravac.control.tables import Smoothed

__all__ = ["DENSE_CF", "Setting", "check_saved_theta_min", "ladder", "within_omega"]

#: the dense fallback: the CF sent when no compressed CF keeps epsilon of the gradient
DENSE_CF = 1.0


@dataclass(frozen=True)
class Setting:
    """What a search is made with.

    Attributes:
        config: the hyperparameters and search options.
        policy: the ladder (or Accordion's settings).
        world_size: number of workers (sets the default EWMA factor).
        snap: the table key of the deliverable CF nearest a requested one
            (:func:`gravac.control.tables.snapper` of the compressor's
            :meth:`gravac.compressors.Compressor.deliverable_cf`): every CF a search plans,
            keeps as a key and sends is a snapped one.
        ranked: the compressor sends a tensor at a rank given per layer
            (:attr:`gravac.compressors.Compressor.takes_ranks`), which Accordion plans.
    """

    config: ControllerConfig
    policy: ScalingPolicy
    world_size: int
    snap: Callable[[float], float]
    ranked: bool = False

    @property
    def theta_min(self) -> float:
        """The config's ``theta_min``, snapped."""
        return self.snap(self.config.theta_min)

    def smoothed(self) -> Smoothed:
        """New EWMA tables at the config's factor for this world size."""
        return Smoothed(self.config.alpha(self.world_size))

    def adaptive(self, search: str) -> None:
        """Refuse a static ladder for ``search``.

        Raises:
            ValueError: the ladder has a ``static_cf``.
        """
        if self.policy.static_cf is not None:
            raise ValueError(
                f"{search} needs an adaptive policy, got {self.policy!r} (a static CF runs "
                "gravac.control.searches.static.StaticController)"
            )

    def saved_theta_min(self, state: dict[str, Any]) -> float:
        """A checkpoint's ``theta_min`` (:func:`check_saved_theta_min` against this config)."""
        return check_saved_theta_min(state["theta_min"], self.theta_min, self.config.theta_max)


def ladder(
    policy: ScalingPolicy,
    theta_min: float,
    theta_max: float,
    snap: Callable[[float], float],
    *,
    above: float,
    s: float | None = None,
    window: int = 0,
) -> list[tuple[float, float, int]]:
    """The ladder's candidate CFs above ``above``, up to ``theta_max``, in order: ``theta_min
    * s`` snapped, ``s`` growing by the policy after each window from ``s`` (default: its first)
    after ``window`` windows; each with the step size and window count the policy continues
    from after it. A CF that snaps to one already listed is listed once."""
    out: list[tuple[float, float, int]] = []
    s, j = (policy.first() if s is None else s), window
    while True:
        want = theta_min * s
        cf = snap(min(want, theta_max))
        s, j = policy.next(s, j + 1), j + 1
        if cf > above and (not out or cf > out[-1][0]):
            out.append((cf, s, j))
        if want >= theta_max:
            return out


def within_omega(tput: dict[float, float], omega: float, prefer: str) -> float:
    """Among the CFs of ``tput`` (compression throughputs, not empty) whose throughput is at
    least ``(1 - omega)`` times the largest, the largest CF (``prefer="bytes"``) or the smallest
    (``"gain"``): :data:`gravac.control.options.PREFERENCES`."""
    floor = (1.0 - omega) * max(tput.values())
    good = [cf for cf, t in tput.items() if t >= floor]
    return max(good) if prefer == "bytes" else min(good)


def check_saved_theta_min(saved: float, lo: float, hi: float) -> float:
    """A checkpoint's ``theta_min``, which must lie in this controller's CF range.

    Raises:
        ValueError: it lies outside ``[lo, hi]``.
    """
    theta_min = float(saved)
    if not lo <= theta_min <= hi:
        raise ValueError(
            f"the checkpoint's theta_min {theta_min:g} is outside this optimizer's CF range "
            f"[theta_min={lo:g}, theta_max={hi:g}]"
        )
    return theta_min
