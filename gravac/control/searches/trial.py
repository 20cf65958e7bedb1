"""The search by trial: every candidate CF is sent for a window and judged by what it delivered.

Algorithm 1 (:mod:`gravac.control.searches.paper`) sends a candidate CF only once its *per-step*
gain, the squared cosine of ``C(x)`` and ``x``, reaches ``epsilon``. Under error feedback that gain
measures the wrong thing: what one step holds back is sent at later steps, so a CF whose per-step
gain is low can still make most of a dense step's progress, and Algorithm 1 never sends it
(``docs/studies/2026-11-30-which-gain.md``). This controller sends each candidate for a whole window
instead and judges it by the gain over that window (:mod:`gravac.control.window`), and by the system
throughput measured while it was sent::

    warm-up:  send theta_min for warmup_steps: theta_min's window (a window's length without
              warm-up); it ends after MIN_WARMUP_STEPS when the link model says that a
              candidate beats theta_min even at epsilon's gain (a slow link)
    search:   window j sends cf_j (cf_0 = theta_min, then the scaling policy's candidates
              theta_min * s, capped at theta_max, less those the link model rules out); the
              step after it carries the window's gain g_j (still sent at cf_j) and ends it:
                  tsys[cf_j] = median samples/s of the window; wgain[cf_j] = g_j
                  tput[cf]   = tsys[cf] * p(wgain[cf])   (compression throughput)
                  g_j < epsilon:                     settle on the best of the CFs kept
                                                     (those with wgain >= epsilon); dense if none
                  cf_j = theta_max:                  settle on the best
                  no CF above cf_j can beat the best tput by more than omega (link model):
                                                     settle on the best
                  otherwise:                         the next candidate
              where the best is the largest kept CF whose tput is within omega of the largest
              (as fast to the target, for fewer bytes); a rejected CF first backs off to the
              candidates the link model skipped below it (the largest first)
    settled:  send theta_ideal; each window's gain and throughput are measured again, and the
              best is chosen again with them (a CF whose gain falls during training gives way
              to a lower kept one that its fall left ahead); one below epsilon backs off to the
              candidates skipped below it, and with no CF kept (or a dense fallback's window
              ending) the search starts again from theta_min; every PROBE_EVERY windows one
              window tries a policy step above theta_ideal, if the link model says it can pay,
              and the best is chosen again

``p(g)`` is the fraction of a dense step's progress that a window gain ``g`` predicts: by
default the gain itself, as the paper's compression throughput takes it; with the option
``progress="cosine"`` its square root (:func:`gravac.control.window.predicted_progress`), which
ranks higher CFs higher. Epsilon thresholds the window gain either way.

The link model gives a CF never sent a throughput: each window also measures the communication its
steps waited for (what backward did not hide, agreed over ranks one step later), and from the
largest CF sent so far, at ``cf0``, a step's seconds per sample at ``cf`` are its others plus its
communication scaled by the bytes, ``t(cf) = (t0 - c0) + c0 * cf0 / cf``
(:func:`gravac.control.link.link_seconds`). It rules out the rest of the search when even theta_max,
at the last window's gain (gains fall as the CF rises), cannot beat the best tput by more than
omega; and it skips a candidate that a higher one beats even at the lowest gain kept (``epsilon``)
against the candidate's highest: on a slow link the search goes straight to the CFs that can pay.
Unlike Algorithm 1's, every decision reads only values all ranks agreed (window gains, step and
communication times), so the ranks decide alike.
"""

from __future__ import annotations

import math
from typing import Any

from gravac.control.link import link_seconds
from gravac.control.records import DENSE, Decision, Observation, Phase, Plan, Report, Skipped
from gravac.control.searches.common import DENSE_CF, Setting, ladder, within_omega
from gravac.control.searches.sent import SentWindows
from gravac.control.window import predicted_progress

__all__ = ["PROBE_EVERY", "TrialController"]

#: a settled search tries the next CF up once every PROBE_EVERY windows (when the link model
#: says it can pay): window gains grow as training goes on (Top-k at CF 100 on the VGG-style
#: digits CNN: 0.53 over steps 1-25, 0.90 over steps 251-275), so a CF rejected early may be
#: kept later; one window in PROBE_EVERY + 1 is the price
PROBE_EVERY = 4
#: what a search window is doing: climbing the policy's candidates, backing off to those the
#: link model skipped on the way to a rejected CF, or probing above a settled CF
_MODES = ("climb", "back", "probe")


class TrialController:
    """The search by trial of the module docstring (``search="trial"``, or ``"auto"`` with a
    compressor the search by shadow cannot replay), made with a ``setting`` of an adaptive
    ladder."""

    def __init__(self, setting: Setting) -> None:
        setting.adaptive("the search by trial")
        self.config, self.policy, self.snap = setting.config, setting.policy, setting.snap
        self.windows = SentWindows(setting)  # the window sent, what windows measured
        self.s = self.policy.first()  # the policy's step size the next candidate continues from
        self.window_index = 0  # of the policy's candidates, those passed
        self.mode = "climb"  # what this search window does (_MODES)
        self.skipped: list[float] = []  # candidates the link model passed over, not yet tried
        self.settled_windows = 0  # windows sent at theta_ideal since it was chosen

    @property
    def phase(self) -> str:
        """Warm-up, search or settled (:class:`gravac.control.records.Phase`)."""
        return self.windows.phase.value

    # ----------------------------------------------------------------- per step
    def plan(self) -> Plan:
        """Send the window's CF (theta_min's compression under a dense fallback)."""
        current, due = self.windows.current, self.windows.awaiting
        if current == DENSE_CF:
            return Plan(self.windows.theta_min, DENSE, window_terms=due)
        return Plan(current, Decision(cf=current, which="min"), window_terms=due)

    def observe(self, seen: Observation | Skipped) -> Report:
        """Fold a step's agreed values; a window that closes with it is judged."""
        if isinstance(seen, Skipped):
            self.windows.discard()
            return Report(self.phase)
        report, closes = self.windows.observe(seen, self._climb)
        if closes:
            self._end_window()
        return report

    # ----------------------------------------------------------------- windows
    def _climb(self) -> list[float]:
        """The candidates above theta_min, from the step size reached."""
        return [cf for cf, _, _ in self._candidates(self.windows.theta_min)]

    def _end_window(self) -> None:
        cf, g = self.windows.close()
        if cf == DENSE_CF:  # a dense fallback's window: try compressing again
            self._reopen()
            return
        if g is not None:
            self.windows.wgain[cf] = g
        rejected = g is not None and g < self.config.epsilon
        if self.windows.phase is Phase.SETTLED:
            self._end_settled_window(cf, rejected)
            return
        if rejected and self.mode != "probe" and self._back_off(cf):
            return
        if rejected or self.mode != "climb" or not self._worth_trying():
            self._settle(self._best())
            return
        nxt = self._next_candidate(cf)
        if nxt is None:
            self._settle(self._best())
        else:
            self.windows.start(nxt)

    def _end_settled_window(self, cf: float, rejected: bool) -> None:
        """A window at theta_ideal: move down to the best kept CF if theta_ideal, measured
        again, fell behind it, probe the next CF up every :data:`PROBE_EVERY` windows, or go on.
        A gain under epsilon first backs off to the candidates the link model skipped below
        theta_ideal; with none, and no CF kept, the search starts again from theta_min.

        Only a probe moves up: it measures the higher CF's gain now, where the table holds one
        from earlier in training (for a lower CF, where gains fall during training as the
        LSTM's do, an optimistic one, which its next window corrects)."""
        if rejected and self._back_off(cf):
            return
        best = self._best()
        if best == DENSE_CF:
            self._reopen()
            return
        # rejected, or its gain fell behind (the LSTM's at CF 40: 0.90 -> 0.78 in 250 steps)
        if rejected or best < cf:
            self._settle(best)
            return
        self.settled_windows += 1
        probe = self._probe_cf() if self.settled_windows % PROBE_EVERY == 0 else None
        if probe is None:
            self.windows.start(cf)
            return
        self.windows.phase, self.mode = Phase.SEARCH, "probe"
        self.windows.start(probe)

    def _back_off(self, rejected: float) -> bool:
        """Start a search window at the largest candidate that the link model skipped between
        the largest kept CF and the ``rejected`` one; ``False`` if there is none."""
        kept = max(self.kept_tput(), default=0.0)
        back = [c for c in self.skipped if kept < c < rejected]
        if not back:
            return False
        self.windows.phase, self.mode = Phase.SEARCH, "back"
        self.skipped.remove(max(back))
        self.windows.start(max(back))
        return True

    def _probe_cf(self) -> float | None:
        """One policy step above theta_ideal, if the link model says it may beat the best
        compression throughput by omega at theta_ideal's gain."""
        ideal = self.windows.theta_ideal
        if ideal is None or ideal == DENSE_CF:
            return None
        probe = self.snap(min(ideal * self.policy.first(), self.config.theta_max))
        best = self.kept_tput()
        predicted = self.predicted_tsys(probe)
        if probe <= ideal or not best:
            return None
        if predicted is not None:
            g = self.worth(self.windows.wgain.get(ideal, 1.0))
            if predicted * g <= (1.0 + self.config.omega) * max(best.values()):
                return None
        return probe

    def _reopen(self) -> None:
        """Search again from theta_min."""
        self.windows.phase, self.windows.theta_ideal = Phase.SEARCH, None
        self.s, self.window_index = self.policy.first(), 0
        self.mode, self.skipped = "climb", []
        self.windows.start(self.windows.theta_min)

    def _candidates(self, above: float) -> list[tuple[float, float, int]]:
        """The policy's candidate CFs above ``above``, up to theta_max, in order, from the
        step size reached (:func:`gravac.control.searches.common.ladder`)."""
        return ladder(
            self.policy,
            self.windows.theta_min,
            self.config.theta_max,
            self.snap,
            above=above,
            s=self.s,
            window=self.window_index,
        )

    def _next_candidate(self, cf: float) -> float | None:
        """The next CF to try above ``cf``: the policy's next candidate, skipping those that
        a higher candidate beats by the link model even at the lowest gain kept (``epsilon``)
        against their own highest (the last window's: gains fall as the CF rises); ``None``
        once no deliverable CF above ``cf`` is left."""
        candidates = self._candidates(cf)
        g, worst = self.worth(self.windows.wgain.get(cf, 1.0)), self.worth(self.config.epsilon)
        predicted = [self.predicted_tsys(c) for c, _, _ in candidates]
        for i, (c, s, j) in enumerate(candidates):
            mine = predicted[i]
            beaten = mine is not None and any(
                p is not None and p * worst >= mine * g for p in predicted[i + 1 :]
            )
            if not beaten:
                self.s, self.window_index = s, j
                self.skipped += [k for k, _, _ in candidates[:i]]
                return c
        return None

    def worth(self, gain: float) -> float:
        """The fraction of a dense step's progress that a window ``gain`` predicts, as the
        config's ``progress`` says (:func:`gravac.control.window.predicted_progress`)."""
        return predicted_progress(gain, self.config.progress_measure)

    def kept_tput(self) -> dict[float, float]:
        """Compression throughput of every CF sent for a window whose gain kept epsilon."""
        eps = self.config.epsilon
        return {
            cf: self.windows.smoothed.tsys[cf] * self.worth(g)
            for cf, g in self.windows.wgain.items()
            if g >= eps and cf in self.windows.smoothed.tsys
        }

    def _best(self) -> float:
        """The largest kept CF whose compression throughput is within omega of the largest
        (as soon at the target, for fewer bytes), or the smallest with ``prefer="gain"``;
        dense if no CF was kept."""
        tput = self.kept_tput()
        if not tput:
            return DENSE_CF
        return within_omega(tput, self.config.omega, self.config.preference)

    def predicted_tsys(self, cf: float) -> float | None:
        """System throughput at ``cf`` from the link model (:func:`link_seconds`), anchored at
        the largest CF sent for a window with its communication measured; ``None`` before
        one was, ``inf`` where the model predicts no cost at all."""
        measured = [
            c for c in self.windows.comm if c in self.windows.smoothed.tsys and c != DENSE_CF
        ]
        if not measured:
            return None
        anchor = max(measured)
        seconds = link_seconds(
            cf, anchor, 1.0 / self.windows.smoothed.tsys[anchor], self.windows.comm[anchor]
        )
        return math.inf if seconds <= 0 else 1.0 / seconds

    def _worth_trying(self) -> bool:
        """Whether a CF above the current one may beat the best compression throughput by
        more than omega: the link model's throughput at theta_max times the last gain."""
        best = self.kept_tput()
        predicted = self.predicted_tsys(self.config.theta_max)
        g = self.windows.wgain.get(self.windows.current)
        if not best or predicted is None or g is None:
            return True
        return predicted * self.worth(g) > (1.0 + self.config.omega) * max(best.values())

    def _settle(self, cf: float) -> None:
        self.mode, self.settled_windows = "climb", 0
        self.windows.settle(cf)

    def resnap(self) -> None:
        """Snap every CF held again, after the deliverable CFs changed (the compressor was
        bound to a new layout)."""
        self.windows.resnap()
        self.skipped = sorted({self.snap(cf) for cf in self.skipped})

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values)."""
        return {
            **self.windows.state_dict(),
            "s": self.s,
            "window_index": self.window_index,
            "mode": self.mode,
            "skipped": list(self.skipped),
            "settled_windows": self.settled_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or a search by shadow's (what it
        measured carries over; the climb starts from the policy's first step).

        Raises:
            ValueError: the saved ``theta_min`` lies outside this controller's CF range, or
                the search mode is not one of its own.
        """
        mode = state.get("mode", "climb")
        if mode not in _MODES:
            raise ValueError(f"the checkpoint's search mode must be one of {_MODES}, got {mode!r}")
        self.windows.load_state_dict(state)
        self.s = float(state.get("s", self.policy.first()))
        self.window_index = int(state.get("window_index", 0))
        self.mode = str(mode)
        self.skipped = [float(v) for v in state.get("skipped", [])]
        self.settled_windows = int(state.get("settled_windows", 0))
