"""The CF a search sends for a window, and what each window measured while it was sent.

The searches by trial (:mod:`gravac.control.searches.trial`) and by shadow
(:mod:`gravac.control.searches.shadow`) both send one CF for a window at a time, and judge it at
the window's end by what its steps measured: the system throughput (median samples per
second), the communication waited for (median seconds per sample) and the window gain. Each
composes a :class:`SentWindows`. A window runs::

    warm-up:  theta_min's first window: warmup_steps steps, or MIN_WARMUP_STEPS where the link
              model says a candidate beats theta_min even at epsilon's gain (a slow link)
    window:   `window` steps at `current`; the step after them (still at `current`) carries the
              window's gain and closes it
    the warm-up lasts FIRST_TIMED_STEPS steps at least: its closing step carries its last
    step's time, and a run's first step is never timed
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any

from gravac.control.link import link_seconds
from gravac.control.records import Observation, Phase, Report
from gravac.control.searches.common import DENSE_CF, Setting
from gravac.control.tables import cf_key
from gravac.control.window import predicted_progress

__all__ = ["FIRST_TIMED_STEPS", "MIN_WARMUP_STEPS", "SentWindows"]

#: warm-up steps before the link model may end it: the first with a step's time and two
#: steps' communication agreed (a step's are agreed at the step after it, and a run's first
#: step is not timed: the engine times a step from the end of the one before)
MIN_WARMUP_STEPS = 3
#: the fewest steps of a warm-up: the step that closes it carries the time of its last step,
#: and the second step is the first timed, so theta_min is judged by a time of its own
FIRST_TIMED_STEPS = 2


class SentWindows:
    """The window open, the CF it sends, and the medians and gains of the windows closed; the
    CF settled on.

    Args:
        setting: what the search is made with; its ``theta_min`` is the first window's CF.
    """

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.config = setting.config
        # the EWMA tables; a closed window's median throughput replaces its CF's in `tsys`
        self.smoothed = setting.smoothed()
        self.theta_min = setting.theta_min  # the lowest CF sent compressed
        self.theta_ideal: float | None = None  # the CF settled on
        self.phase = Phase.WARMUP if self.config.warmup_steps > 0 else Phase.SEARCH
        self.current = self.theta_min  # the CF this window sends
        self.step = 0  # steps into the window (or warm-up)
        self.clock = 0  # steps since the last window gain was measured
        self.awaiting = False  # the window is complete: this step carries its gain
        self.wgain: dict[float, float] = {}  # the last window gain measured at each CF
        self.comm: dict[float, float] = {}  # exposed communication seconds per sample, by CF
        self.gain_now: float | None = None  # this step's agreed window gain, if any
        self.samples: list[float] = []  # samples/s of this window's steps at `current`
        self.comm_samples: list[float] = []  # this window's, at `current`

    def take(self, seen: Observation) -> None:
        """A step's samples at the CF this window sends, and the window gain it carries."""
        t, c = seen.throughput, seen.comm
        if t is not None and cf_key(t.cf) == self.current:
            self.samples.append(t.value)
        if c is not None and cf_key(c.cf) == self.current:
            self.comm_samples.append(c.value)
        if seen.plan.window_terms:
            self.clock = 0
            self.gain_now = math.nan if seen.gain_window is None else seen.gain_window

    def observe(
        self, seen: Observation, candidates: Callable[[], Iterable[float]]
    ) -> tuple[Report, bool]:
        """Fold a step's agreed values (:meth:`take`, the smoothed tables) and count it
        (:meth:`tick`; ``candidates``: the CFs above theta_min that may end the warm-up early,
        :meth:`beats_theta_min`): what the step is logged with, and whether the window closes
        now."""
        self.smoothed.fold(seen)
        self.take(seen)
        report = self.smoothed.report(self.phase.value, seen.plan)
        return report, self.tick(lambda: self.beats_theta_min(candidates))

    def discard(self) -> None:
        """A step skipped on every rank: the window gain it was to carry is measured again."""
        self.gain_now = None

    def tick(self, beaten: Callable[[], bool]) -> bool:
        """Count a step; ``True`` when it carried the window's gain and the window closes now.
        ``beaten``: whether the link model ends the warm-up early (asked at the warm-up's steps
        that do not end it by their count)."""
        self.clock += 1
        if self.awaiting:
            return True
        self.step += 1
        if self.phase is Phase.WARMUP:  # warm-up is theta_min's first window
            least = max(self.config.warmup_steps, FIRST_TIMED_STEPS)
            if self.step >= least or beaten():
                self.phase, self.awaiting = Phase.SEARCH, True
        elif self.step >= self.config.window:
            self.awaiting = True
        return False

    def start(self, cf: float) -> None:
        """Open a window that sends ``cf``."""
        self.current = cf
        self.step = 0
        self.awaiting = False
        self.samples = []
        self.comm_samples = []
        self.gain_now = None

    def settle(self, cf: float) -> None:
        """Settle on ``cf``: send it from the next window on."""
        self.theta_ideal = cf_key(cf)
        self.phase = Phase.SETTLED
        self.start(self.theta_ideal)

    def value(self) -> float | None:
        """The gain that judges the window: the window gain, or without one (no error
        feedback) the smoothed per-step gain of the CF sent."""
        g = self.gain_now
        if g is not None and math.isfinite(g):
            return g
        return self.smoothed.gain.get(self.current)

    def close(self) -> tuple[float, float | None]:
        """The CF the window sent and the gain that judges it; the window's system throughput
        and communication recorded for that CF (medians of its steps)."""
        cf = self.current
        if self.samples:
            self.smoothed.tsys[cf] = statistics.median(self.samples)
        if self.comm_samples:
            self.comm[cf] = statistics.median(self.comm_samples)
        return cf, self.value()

    def beats_theta_min(self, candidates: Callable[[], Iterable[float]]) -> bool:
        """Whether, by the link model of the warm-up so far, one of ``candidates`` beats
        ``theta_min`` even at the progress epsilon's gain predicts against theta_min's 1: on a
        slow link the warm-up then ends after :data:`MIN_WARMUP_STEPS` (each of its steps is the
        most expensive there is)."""
        if self.step < MIN_WARMUP_STEPS or not self.samples or not self.comm_samples:
            return False
        tsys = statistics.median(self.samples)
        comm = statistics.median(self.comm_samples)
        worst = predicted_progress(self.config.epsilon, self.config.progress_measure)
        for cf in candidates():
            seconds = link_seconds(cf, self.theta_min, 1.0 / tsys, comm)
            if seconds <= 0 or worst / seconds >= tsys:
                return True
        return False

    def resnap(self) -> None:
        """Snap every CF held again, after the deliverable CFs changed (the compressor was
        bound to a new layout)."""
        snap = self.setting.snap
        self.theta_min = snap(self.theta_min)
        if self.theta_ideal is not None:
            self.theta_ideal = snap(self.theta_ideal)
        self.smoothed.resnap(snap)
        if self.current != DENSE_CF:
            self.current = snap(self.current)
        self.wgain = {snap(cf): v for cf, v in sorted(self.wgain.items())}
        self.comm = {snap(cf): v for cf, v in sorted(self.comm.items())}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the window exactly (plain Python values)."""
        return {
            "config": asdict(self.config),
            "theta_min": self.theta_min,
            "theta_ideal": self.theta_ideal,
            **self.smoothed.state_dict(),
            "phase": self.phase.value,
            "window_step": self.step,
            "window_clock": self.clock,
            "current": self.current,
            "awaiting": self.awaiting,
            "wgain": sorted(self.wgain.items()),
            "samples": list(self.samples),
            "comm": sorted(self.comm.items()),
            "comm_samples": list(self.comm_samples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the saved ``theta_min`` lies outside this search's CF range.
        """
        self.theta_min = self.setting.saved_theta_min(state)
        ideal = state["theta_ideal"]
        self.theta_ideal = None if ideal is None else float(ideal)
        self.smoothed.load_state_dict(state)
        self.phase = Phase(state["phase"])
        self.step = int(state["window_step"])
        self.clock = int(state.get("window_clock", 0))
        self.current = float(state["current"])
        self.awaiting = bool(state["awaiting"])
        self.wgain = {float(k): float(v) for k, v in state["wgain"]}
        self.samples = [float(v) for v in state["samples"]]
        self.comm = {float(k): float(v) for k, v in state["comm"]}
        self.comm_samples = [float(v) for v in state["comm_samples"]]
        self.gain_now = None
