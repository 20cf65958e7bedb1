"""The GraVAC controller: which CF to evaluate and which to send (GraVAC Algorithm 1).

Tyagi and Swany, "GraVAC: Adaptive Compression for Communication-Efficient Distributed DL
Training", IEEE CLOUD 2023, Algorithm 1, as docs/design.md section 9.1 states it. Every step the
engine compresses at ``theta_min`` and, outside warm-up, at a candidate
``theta_c = min(theta_min * s, theta_max)``; the controller chooses what to send::

    warm-up:                          send theta_min
    gain[theta_c]   >= epsilon:       send theta_c
    gain[theta_min] >= epsilon:       send theta_min
    otherwise:                        send dense (CF 1) and reset the residuals

where ``gain[.]`` are EWMAs of the compression gain (:mod:`gravac.gain`,
:mod:`gravac.control.tables`). It keeps the system
throughput ``tsys[cf]`` (global samples per second while sending at ``cf``) and the compression
throughput ``tput[cf] = tsys[cf] * gain[cf]`` (``gain[1] = 1``). At the end of every window of
search steps::

    if |gain[theta_c] - gain[theta_min]| <= omega * gain[theta_min]:  theta_min = theta_c
    (cf1, cf2) = the two CFs of largest tput
    if tput[cf1] - tput[cf2] <= omega * tput[cf1]:   theta_ideal = min(cf1, cf2); settle
    else:                                            s = policy.next(s)

and a settled controller reopens the search when ``gain[theta_ideal]`` drops below ``epsilon``.

.. note::
   Two choices where the paper is silent: ``theta_ideal`` is never below ``theta_min`` (it is
   clamped up, since the controller sends nothing under ``theta_min`` except the dense
   fallback); and once the candidate has reached ``theta_max`` and been evaluated for a window
   without saturating, the search settles on the CF of largest ``tput`` rather than re-testing
   ``theta_max`` forever.

Every input (gains, step times) must be agreed by all ranks before it reaches the controller:
the controller is deterministic, so identical inputs give identical decisions on every rank.

The decision at step t reads the EWMAs through step t - 1 (docs/design.md section 8), so
that it is known before step t's gradients exist and each bucket can be sent as soon as it is
ready; step t's own gains reach :meth:`PaperController.observe` afterwards.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gravac.control.records import DENSE, Decision, Observation, Phase, Plan, Report, Skipped
from gravac.control.searches.common import Setting
from gravac.control.tables import cf_key

__all__ = ["PaperController"]


class PaperController:
    """GraVAC's Algorithm 1; see the module docstring (a ladder's ``search="paper"``).

    Args:
        setting: what it is made with (an adaptive ladder: how the step size ``s`` grows).
    """

    def __init__(self, setting: Setting) -> None:
        setting.adaptive("Algorithm 1")
        self.setting, self.config, self.policy = setting, setting.config, setting.policy
        self.snap = setting.snap
        self.smoothed = setting.smoothed()
        self.theta_min = setting.theta_min
        self.s = self.policy.first()
        self.theta_ideal: float | None = None
        self.window_index = 0  # search windows completed
        self.window_step = 0  # steps into the current window (or warm-up)
        self.window_clock = 0  # steps since the last window gain was measured (logged only)
        self._phase = Phase.WARMUP if self.config.warmup_steps > 0 else Phase.SEARCH

    @property
    def phase(self) -> str:
        """Warm-up, search or settled (:class:`gravac.control.records.Phase`)."""
        return self._phase.value

    @property
    def theta_c(self) -> float:
        """The candidate CF: ``min(theta_min * s, theta_max)`` (theta_ideal once settled)."""
        if self._phase is Phase.SETTLED and self.theta_ideal is not None:
            return self.theta_ideal
        return self.snap(min(self.theta_min * self.s, self.config.theta_max))

    # ----------------------------------------------------------------- per step
    def plan(self) -> Plan:
        """Compress at theta_min and, outside warm-up, at the candidate; send the candidate
        if its smoothed gain keeps epsilon, else theta_min if its does (or is not known yet),
        else dense. A candidate is first measured, then sent from its next step on."""
        due = self.window_clock >= self.config.window
        if self._phase is Phase.WARMUP or self.theta_c <= self.theta_min:
            return Plan(self.theta_min, self._decide(None), window_terms=due)
        candidate = self.theta_c
        return Plan(self.theta_min, self._decide(candidate), candidate, window_terms=due)

    def _decide(self, candidate: float | None) -> Decision:
        if self._phase is Phase.WARMUP:
            return Decision(cf=self.theta_min, which="min")
        eps, gain = self.config.epsilon, self.smoothed.gain
        g_c = None if candidate is None else gain.get(cf_key(candidate))
        if candidate is not None and g_c is not None and g_c >= eps:
            return Decision(cf=candidate, which="candidate")
        g_min = gain.get(cf_key(self.theta_min))
        if g_min is None or g_min >= eps:
            return Decision(cf=self.theta_min, which="min")
        return DENSE

    def observe(self, seen: Observation | Skipped) -> Report:
        """Fold a step's agreed gains and throughput; at a window's end apply the rules."""
        if isinstance(seen, Skipped):
            return Report(self.phase)
        if seen.plan.window_terms:
            self.window_clock = 0
        self.smoothed.fold(seen)
        report = self.smoothed.report(self.phase, seen.plan)
        self._end_step()
        return report

    def _end_step(self) -> None:
        self.window_clock += 1
        self.window_step += 1
        if self._phase is Phase.WARMUP:
            if self.window_step >= self.config.warmup_steps:
                self._phase = Phase.SEARCH
                self.window_step = 0
            return
        if self.window_step < self.config.window:
            return
        self.window_step = 0
        if self._phase is Phase.SEARCH:
            self._end_search_window()
        elif self.theta_ideal is not None:
            g = self.smoothed.gain.get(cf_key(self.theta_ideal))
            if g is not None and g < self.config.epsilon:
                self._phase = Phase.SEARCH
                self.theta_ideal = None

    def _end_search_window(self) -> None:
        self.window_index += 1
        theta_c = self.theta_c
        omega = self.config.omega
        g_min = self.smoothed.gain.get(cf_key(self.theta_min))
        g_c = self.smoothed.gain.get(theta_c)
        close = g_min is not None and g_c is not None and abs(g_c - g_min) <= omega * g_min
        if theta_c > self.theta_min and close:
            self.theta_min = theta_c
        if self.snap(self.config.theta_max) <= self.theta_min:  # no higher CF can be delivered
            self._settle(self.theta_min)
            return
        ranked = sorted(self.smoothed.tput().items(), key=lambda kv: (-kv[1], kv[0]))
        if len(ranked) >= 2 and ranked[0][1] - ranked[1][1] <= omega * ranked[0][1]:
            self._settle(min(ranked[0][0], ranked[1][0]))
        elif theta_c >= self.config.theta_max and ranked:
            self._settle(ranked[0][0])
        else:
            self.s = self.policy.next(self.s, self.window_index)

    def _settle(self, cf: float) -> None:
        self.theta_ideal = cf_key(max(cf, self.theta_min))
        self._phase = Phase.SETTLED

    def resnap(self) -> None:
        """Snap every CF held again, after the deliverable CFs changed (the compressor was
        bound to a new layout): ``theta_min``, ``theta_ideal`` and the table keys (where two
        keys meet, the larger CF's entry is kept)."""
        self.theta_min = self.snap(self.theta_min)
        if self.theta_ideal is not None:
            self.theta_ideal = self.snap(self.theta_ideal)
        self.smoothed.resnap(self.snap)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values)."""
        return {
            "config": asdict(self.config),
            "theta_min": self.theta_min,
            "s": self.s,
            "phase": self.phase,
            "theta_ideal": self.theta_ideal,
            "window_index": self.window_index,
            "window_step": self.window_step,
            **self.smoothed.state_dict(),
            "window_clock": self.window_clock,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the saved ``theta_min`` lies outside this controller's CF range.
        """
        self.theta_min = self.setting.saved_theta_min(state)
        self.s = float(state["s"])
        self._phase = Phase(state["phase"])
        ideal = state["theta_ideal"]
        self.theta_ideal = None if ideal is None else float(ideal)
        self.window_index = int(state["window_index"])
        self.window_step = int(state["window_step"])
        self.smoothed.load_state_dict(state)
        self.window_clock = int(state.get("window_clock", 0))
