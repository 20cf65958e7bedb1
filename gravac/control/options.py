"""The controller's settings: its hyperparameters and the search that runs its ladder.

One frozen record, checked when made (:class:`ControllerConfig`); the defaults and why each is
what it is are in its docstring. Which search runs a ladder is chosen from it by
:func:`gravac.control.factory.make_controller`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gravac.checks import check_cf, is_integer, is_real
from gravac.control.window import PROGRESS_MEASURES

__all__ = ["DEFAULT_HORIZON", "PREFERENCES", "SEARCHES", "SHADOW_ONLY", "ControllerConfig"]

#: how an adaptive ladder's candidates are judged: each sent for a window and judged by the
#: gain error feedback delivered over it (:mod:`gravac.control.searches.trial`), GraVAC's
#: Algorithm 1 as the paper states it, by each step's gain
#: (:mod:`gravac.control.searches.paper`), all at once by error feedback replayed on a sample,
#: without sending them (:mod:`gravac.control.searches.shadow`), or ``"auto"``: by shadow where
#: the compressor's sends can be replayed (a sparsifier under plain error feedback), else by trial
SEARCHES = ("trial", "paper", "shadow", "auto")
#: the searches that may run the options only the search by shadow takes
SHADOW_ONLY = ("shadow", "auto")
#: windows the search by shadow's window gains span unless told: a high CF's residual is
#: delivered steps later, so a gain over two windows (50 steps, decisions still every 25) judges
#: it over more of what error feedback delivers; 2 sent as many bytes as 1 or fewer and reached
#: the target as soon, and 3 or 4 did no better (``docs/studies/2026-12-01-window-horizon.md``)
DEFAULT_HORIZON = 2
#: which CF the searches by trial and shadow send among those whose compression throughput is
#: within omega of the largest (as soon at the target by their model): the largest (``"bytes"``:
#: fewest bytes) or the smallest (``"gain"``: least compression error, which a window gain may
#: underrate; Algorithm 1 settles so, on ``min(cf1, cf2)``)
PREFERENCES = ("bytes", "gain")
#: EWMA smoothing per worker: alpha = min(1, N * _ALPHA_PER_WORKER), the paper's N / 100.
_ALPHA_PER_WORKER = 0.01


@dataclass(frozen=True)
class ControllerConfig:
    """Hyperparameters of the searches, and which search runs an adaptive ladder.

    Attributes:
        theta_min: the lowest CF ever sent compressed (it may escalate under Algorithm 1).
        theta_max: the highest CF the search may reach.
        epsilon: minimum gain for a compressed CF to be sent (Algorithm 1: smoothed per-step
            gain) or kept (the searches by trial and shadow: window gain).
        omega: relative tolerance for "gains close enough to escalate theta_min" and for
            "compression throughput saturated" (the other searches: "as good").
        window: steps each candidate CF is evaluated for.
        warmup_steps: steps at theta_min before the search starts (the searches by trial and
            shadow: theta_min's window, at least two steps: a run's first is not timed).
        ewma_alpha: gain and throughput smoothing; ``None`` picks ``min(1, N / 100)``.
        search: the search that runs an adaptive ladder (:data:`SEARCHES`).
        progress: how the searches by trial and shadow predict a CF's progress per step from
            its window gain (:data:`gravac.control.window.PROGRESS_MEASURES`; ``None``:
            ``"energy"``). Algorithm 1 ranks by its per-step gain and takes none.
        horizon: windows the search by shadow's window gains span (``None``:
            :data:`DEFAULT_HORIZON`); only it takes more than one.
        noise: whether the search by shadow counts held-back energy by its signal share
            (:mod:`gravac.control.noise`; ``None``: on); only it measures the share.
        prefer: which CF the searches by trial and shadow send among those as good within
            omega (:data:`PREFERENCES`; ``None``: ``"bytes"``). Algorithm 1 takes none.

    Defaults: the CF range 10..1000 is the paper's; window 25 is the reference code's
    (sahiltyagi4/GraVAC). ``omega`` is 0.1, not that code's 0.05: the searches by trial and by
    shadow compare throughputs measured or modelled from a window's noisy step times, and with
    0.05 the noise moved them off CF 10 on workloads whose step time compression barely changes
    (``docs/studies/2026-12-01-six-seeds-omega.md``). Algorithm 1 (``search="paper"``) takes the
    reference code's with ``omega=0.05``. ``epsilon`` is 0.5, not the reference code's 0.75,
    because that code thresholds a ratio of *norms* while this gain is a squared cosine, an
    energy ratio (0.75 of the norm is 0.56 of the energy): a CF is sent or kept while it keeps at
    least half the gradient's energy, per step under Algorithm 1, over a window under the other
    searches (``docs/studies/2026-11-30-which-gain.md``). The warm-up is 10 steps, shorter than
    the reference code's one window: the warm-up sends theta_min, which on a slow link is the
    most expensive CF, except at the steps whose time the search by shadow does not read
    (:mod:`gravac.control.searches.shadow`).

    Raises:
        ValueError: a value out of its range, or an option only the search by shadow takes
            with a search that cannot run it.
    """

    theta_min: float = 10.0
    theta_max: float = 1000.0
    epsilon: float = 0.5
    omega: float = 0.1
    window: int = 25
    warmup_steps: int = 10
    ewma_alpha: float | None = None
    search: str = "auto"
    progress: str | None = None
    horizon: int | None = None
    noise: bool | None = None
    prefer: str | None = None

    def __post_init__(self) -> None:
        check_cf(self.theta_min, name="theta_min")
        check_cf(self.theta_max, name="theta_max")
        if self.theta_max < self.theta_min:
            raise ValueError(
                f"theta_max must be >= theta_min ({self.theta_min}), got {self.theta_max}"
            )
        for name, value in (("epsilon", self.epsilon), ("omega", self.omega)):
            if not (is_real(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
            object.__setattr__(self, name, float(value))
        for name, value, least in (
            ("window", self.window, 1),
            ("warmup_steps", self.warmup_steps, 0),
        ):
            if not (is_integer(value) and value >= least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))
        a = self.ewma_alpha
        if a is not None and not (is_real(a) and 0.0 < a <= 1.0):
            raise ValueError(f"ewma_alpha must be None or a number in (0, 1], got {a!r}")
        self._check_search()

    def _check_search(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.search!r}")
        self._not_paper("progress", PROGRESS_MEASURES, "ranks by Algorithm 1's per-step gain")
        self._not_paper("prefer", PREFERENCES, "settles on the smaller of two CFs within omega")
        h = self.horizon
        if h is not None and not (is_integer(h) and h >= 1):
            raise ValueError(f"horizon must be None or an integer >= 1, got {h!r}")
        if h is not None and h > 1:
            self._shadow_only("horizon", h, "judges a window at a time")
        if self.noise is not None and not isinstance(self.noise, bool):
            raise ValueError(f"noise must be True, False or None, got {self.noise!r}")
        if self.noise:
            self._shadow_only("noise", self.noise, "does not measure the signal share")

    def _not_paper(self, option: str, choices: tuple[str, ...], why: str) -> None:
        """Check ``option`` of the searches by trial and shadow: ``None`` or one of
        ``choices``, and not given to Algorithm 1 (``why``: what it does instead)."""
        value = getattr(self, option)
        if value is not None and value not in choices:
            raise ValueError(f"{option} must be one of {choices} or None, got {value!r}")
        if self.search == "paper" and value is not None:
            raise ValueError(
                f"{option} applies to the searches by trial and shadow; search='paper' {why}, "
                f"got {option}={value!r}"
            )

    def _shadow_only(self, option: str, value: object, why: str) -> None:
        """Refuse ``option=value``, which only the search by shadow takes, with a search that
        cannot run it (``why``: what that search does instead); ``"auto"`` runs it where the
        compressor can be replayed, and the factory refuses it elsewhere."""
        if self.search not in SHADOW_ONLY:
            raise ValueError(
                f"{option} applies to the search by shadow; search={self.search!r} {why}, got "
                f"{option}={value!r}"
            )

    @property
    def progress_measure(self) -> str:
        """The progress measure the searches by trial and shadow rank by."""
        return "energy" if self.progress is None else self.progress

    @property
    def preference(self) -> str:
        """Which CF within omega the searches by trial and shadow send (:data:`PREFERENCES`)."""
        return "bytes" if self.prefer is None else self.prefer

    def alpha(self, world_size: int) -> float:
        """The EWMA factor for ``world_size`` workers."""
        if self.ewma_alpha is not None:
            return float(self.ewma_alpha)
        return min(1.0, world_size * _ALPHA_PER_WORKER)
