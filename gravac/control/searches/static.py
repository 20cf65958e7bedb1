"""A static CF: the same CF sent at every step, the baseline every search is compared with.

No search and no fallback: the plan sends the ladder's ``static_cf`` at every step
(:class:`gravac.control.policies.FixedPolicy`), after its ``static_warmup`` schedule: step
``t`` (counted from 0 over the steps not skipped) of a schedule ``(n_1, cf_1), (n_2, cf_2), ...``
sends ``cf_j`` for the first ``j`` with ``t < n_1 + ... + n_j``, the static CF after them.
Once a window (``config.window`` steps) a step carries the window gain under error feedback,
which the engine logs; with the policy's ``measure`` each step's gain is measured and smoothed
too, so a static run shows what the searches would have seen.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gravac.control.records import Decision, Observation, Plan, Report, Skipped
from gravac.control.searches.common import Setting

__all__ = ["PHASE", "StaticController"]

#: the phase a static CF reports at every step
PHASE = "fixed"


class StaticController:
    """Send ``policy.static_cf`` at every step; see the module docstring.

    Args:
        setting: what it is made with (a ladder with a ``static_cf``; the config's ``window``:
            how often the window gain is logged).
    """

    def __init__(self, setting: Setting) -> None:
        static = setting.policy.static_cf
        if static is None:
            raise ValueError(f"a static CF needs a policy with static_cf, got {setting.policy!r}")
        self.setting, self.config, self.policy = setting, setting.config, setting.policy
        self.snap = setting.snap
        self.static_cf = static  # the CF asked for; the plan sends its snap
        self.smoothed = setting.smoothed()
        self.window_clock = 0  # steps since the last window gain was measured
        self.steps = 0  # steps observed, not skipped: where the warm-up schedule stands

    @property
    def phase(self) -> str:
        """Always :data:`PHASE`."""
        return PHASE

    def planned_cf(self) -> float:
        """The CF this step sends as asked: the warm-up's at its step, else the static CF."""
        end = 0
        for steps, cf in self.policy.static_warmup:
            end += steps
            if self.steps < end:
                return cf
        return self.static_cf

    def plan(self) -> Plan:
        """Send the planned CF, snapped; carry the window's gain once a window."""
        due = self.window_clock >= self.config.window
        cf = self.snap(self.planned_cf())
        send = Decision(cf=cf, which="min")
        return Plan(cf, send, measure=self.policy.measure, window_terms=due)

    def observe(self, seen: Observation | Skipped) -> Report:
        """Fold a step's agreed throughput (and gains, with ``measure``)."""
        if isinstance(seen, Skipped):
            return Report(PHASE)
        if seen.plan.window_terms:
            self.window_clock = 0
        self.smoothed.fold(seen)
        self.window_clock += 1
        self.steps += 1
        return self.smoothed.report(PHASE, seen.plan)

    def resnap(self) -> None:
        """Snap the table keys again, after the deliverable CFs changed."""
        self.smoothed.resnap(self.snap)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values)."""
        return {
            "config": asdict(self.config),
            "theta_min": self.setting.theta_min,
            "phase": PHASE,
            **self.smoothed.state_dict(),
            "window_clock": self.window_clock,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (or an older static controller's).

        Raises:
            ValueError: the saved ``theta_min`` lies outside this controller's CF range.
        """
        self.setting.saved_theta_min(state)
        self.smoothed.load_state_dict(state)
        self.window_clock = int(state.get("window_clock", 0))
        self.steps = int(state.get("steps", 0))
