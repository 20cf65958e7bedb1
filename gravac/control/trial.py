"""The search by trial: every candidate CF is sent for a window and judged by what it delivered.

Algorithm 1 (:mod:`gravac.control.controller`) sends a candidate CF only once its *per-step* gain,
the squared cosine of ``C(x)`` and ``x``, reaches ``epsilon``. Under error feedback that gain
measures the wrong thing: what one step holds back is sent at later steps, so a CF whose
per-step gain is low can still make most of a dense step's progress, and Algorithm 1 never sends
it (``docs/studies/2026-11-30-which-gain.md``). This controller sends each candidate for a whole
window instead and judges it by the gain over that window (:mod:`gravac.control.window`), and by the
system throughput measured while it was sent::

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
default the gain itself, as the paper's compression throughput takes it; with the policy option
``progress="cosine"`` its square root (:func:`gravac.control.window.predicted_progress`), which
ranks higher CFs higher. Epsilon thresholds the window gain either way.

The link model gives a CF never sent a throughput: each window also measures the communication
its steps waited for (what backward did not hide, agreed over ranks one step later), and from
the largest CF sent so far, at ``cf0``, a step's seconds per sample at ``cf`` are its others
plus its communication scaled by the bytes, ``t(cf) = (t0 - c0) + c0 * cf0 / cf``
(:func:`link_seconds`). It rules out the rest of the search when even theta_max, at the last
window's gain (gains fall as the CF rises), cannot beat the best tput by more than omega; and it
skips a candidate that a higher one beats even at the lowest gain kept (``epsilon``) against
the candidate's highest: on a slow link the search goes straight to the CFs that can pay.
Unlike Algorithm 1's, every decision reads only values all ranks agreed (window gains, step and
communication times), so the ranks decide alike.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from gravac.control.controller import Controller, Decision, Phase, Plan, cf_key
from gravac.control.window import predicted_progress

__all__ = ["TrialController", "between_seconds", "link_seconds"]

#: the dense fallback: the CF sent when no compressed CF keeps epsilon of the gradient
_DENSE_CF = 1.0
#: a settled search tries the next CF up once every PROBE_EVERY windows (when the link model
#: says it can pay): window gains grow as training goes on (Top-k at CF 100 on the VGG-style
#: digits CNN: 0.53 over steps 1-25, 0.90 over steps 251-275), so a CF rejected early may be
#: kept later; one window in PROBE_EVERY + 1 is the price
PROBE_EVERY = 4
#: warm-up steps before the link model may end it: the first with two agreed step times (a
#: step's time and communication are agreed at the step after it)
MIN_WARMUP_STEPS = 3
#: what a search window is doing: climbing the policy's candidates, backing off to those the
#: link model skipped on the way to a rejected CF, or probing above a settled CF
_MODES = ("climb", "back", "probe")


def link_seconds(cf: float, anchor: float, seconds: float, comm: float) -> float:
    """Seconds per sample at ``cf`` from one measured at ``anchor``: ``seconds`` in all, of
    which ``comm`` waiting for communication; the communication scales with the bytes, as
    ``1 / cf``, the rest stays::

        t(cf) = (seconds - comm) + comm * anchor / cf
    """
    return seconds - comm + comm * anchor / cf


def between_seconds(cf: float, lo: float, t_lo: float, hi: float, t_hi: float) -> float:
    """Seconds per sample at ``cf`` between two CFs whose steps were timed, ``lo < cf < hi``
    (``t_lo`` and ``t_hi`` seconds per sample): linear in the bytes sent, ``1 / cf``::

        t(cf) = t_hi + (t_lo - t_hi) * (1/cf - 1/hi) / (1/lo - 1/hi)

    Unlike :func:`link_seconds` it scales all that the two steps' times differ by, not only
    the communication waited for: where compression costs grow with the elements kept (Top-k
    on the CPU: 33 ms a step at CF 10 against 12 ms at CF 100 on the VGG-style digits CNN),
    they are part of what a higher CF saves."""
    return t_hi + (t_lo - t_hi) * (1.0 / cf - 1.0 / hi) / (1.0 / lo - 1.0 / hi)


class TrialController(Controller):
    """The search by trial; see the module docstring. Same arguments as
    :class:`gravac.control.controller.Controller` (a policy's ``search="trial"``, or ``"auto"``, the
    default, with a compressor the search by shadow cannot replay)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.phase is Phase.FIXED:
            raise ValueError(
                f"the search by trial needs an adaptive policy, got {self.policy!r} (a static "
                "CF runs gravac.control.controller.Controller)"
            )
        self.current = self.theta_min  # the CF this window sends
        self.awaiting = False  # the window is complete: this step carries its gain
        self.wgain: dict[float, float] = {}  # the last window gain measured at each CF
        self._window_gain: float | None = None  # this step's agreed window gain, if any
        self._samples: list[float] = []  # samples/s of this window's steps at `current`
        self.comm: dict[float, float] = {}  # exposed communication seconds per sample, by CF
        self._comm_samples: list[float] = []  # this window's, at `current`
        self.mode = "climb"  # what this search window does (_MODES)
        self.skipped: list[float] = []  # candidates the link model passed over, not yet tried
        self.settled_windows = 0  # windows sent at theta_ideal since it was chosen

    # ----------------------------------------------------------------- per step
    def plan(self) -> Plan:
        sent = self.theta_min if self.current == _DENSE_CF else self.current
        return Plan(theta_min=sent, candidate=None, window_terms=self.awaiting)

    def decide(self, plan: Plan) -> Decision:
        if self.current == _DENSE_CF:
            return Decision(cf=_DENSE_CF, which="dense")
        return Decision(cf=plan.theta_min, which="min")

    def observe_window(self, plan: Plan, gain: float) -> None:
        super().observe_window(plan, gain)
        self._window_gain = gain

    def record_throughput(self, cf: float, samples_per_second: float) -> None:
        super().record_throughput(cf, samples_per_second)
        if cf_key(cf) == self.current:
            self._samples.append(samples_per_second)

    def record_comm(self, cf: float, seconds_per_sample: float) -> None:
        if cf_key(cf) == self.current:
            self._comm_samples.append(seconds_per_sample)

    def end_step(self) -> None:
        self.window_clock += 1
        if self.awaiting:
            self._end_window()
            return
        self.window_step += 1
        if self.phase is Phase.WARMUP:  # warm-up is theta_min's first window
            if self.window_step >= self.config.warmup_steps or self._theta_min_beaten():
                self.phase, self.awaiting = Phase.SEARCH, True
        elif self.window_step >= self.config.window:
            self.awaiting = True

    def discard_step(self) -> None:
        self._window_gain = None

    # ----------------------------------------------------------------- windows
    def _start_window(self, cf: float) -> None:
        self.current = cf
        self.window_step = 0
        self.awaiting = False
        self._samples = []
        self._comm_samples = []
        self._window_gain = None

    def _window_value(self) -> float | None:
        """The gain that judges the window: the window gain, or without one (no error
        feedback) the smoothed per-step gain of the CF sent."""
        g = self._window_gain
        if g is not None and math.isfinite(g):
            return g
        return self.gain.get(self.current)

    def _theta_min_beaten(self) -> bool:
        """Whether, by the link model of the warm-up so far, some candidate beats theta_min
        even at epsilon's gain against theta_min's 1: on a slow link the warm-up then ends
        after :data:`MIN_WARMUP_STEPS` (each of its steps is the most expensive there is)."""
        if self.window_step < MIN_WARMUP_STEPS or not self._samples or not self._comm_samples:
            return False
        tsys = statistics.median(self._samples)
        comm = statistics.median(self._comm_samples)
        worst = self.worth(self.config.epsilon)
        for cf, _, _ in self._candidates(self.theta_min):
            seconds = link_seconds(cf, self.theta_min, 1.0 / tsys, comm)
            if seconds <= 0 or worst / seconds >= tsys:
                return True
        return False

    def _close_window(self) -> tuple[float, float | None]:
        """The CF the window sent and the gain that judges it; the window's system throughput
        and communication recorded for that CF (medians of its steps)."""
        cf = self.current
        if self._samples:
            self.tsys[cf] = statistics.median(self._samples)
        if self._comm_samples:
            self.comm[cf] = statistics.median(self._comm_samples)
        return cf, self._window_value()

    def _end_window(self) -> None:
        cf, g = self._close_window()
        if cf == _DENSE_CF:  # a dense fallback's window: try compressing again
            self._reopen()
            return
        if g is not None:
            self.wgain[cf] = g
        rejected = g is not None and g < self.config.epsilon
        if self.phase is Phase.SETTLED:
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
            self._start_window(nxt)

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
        if best == _DENSE_CF:
            self._reopen()
            return
        # rejected, or its gain fell behind (the LSTM's at CF 40: 0.90 -> 0.78 in 250 steps)
        if rejected or best < cf:
            self._settle(best)
            return
        self.settled_windows += 1
        probe = self._probe_cf() if self.settled_windows % PROBE_EVERY == 0 else None
        if probe is None:
            self._start_window(cf)
            return
        self.phase, self.mode = Phase.SEARCH, "probe"
        self._start_window(probe)

    def _back_off(self, rejected: float) -> bool:
        """Start a search window at the largest candidate that the link model skipped between
        the largest kept CF and the ``rejected`` one; ``False`` if there is none."""
        kept = max(self.kept_tput(), default=0.0)
        back = [c for c in self.skipped if kept < c < rejected]
        if not back:
            return False
        self.phase, self.mode = Phase.SEARCH, "back"
        self.skipped.remove(max(back))
        self._start_window(max(back))
        return True

    def _probe_cf(self) -> float | None:
        """One policy step above theta_ideal, if the link model says it may beat the best
        compression throughput by omega at theta_ideal's gain."""
        ideal = self.theta_ideal
        if ideal is None or ideal == _DENSE_CF:
            return None
        probe = self.snap(min(ideal * self.policy.first(), self.config.theta_max))
        best = self.kept_tput()
        predicted = self.predicted_tsys(probe)
        if probe <= ideal or not best:
            return None
        if predicted is not None:
            g = self.worth(self.wgain.get(ideal, 1.0))
            if predicted * g <= (1.0 + self.config.omega) * max(best.values()):
                return None
        return probe

    def _reopen(self) -> None:
        """Search again from theta_min."""
        self.phase, self.theta_ideal = Phase.SEARCH, None
        self.s, self.window_index = self.policy.first(), 0
        self.mode, self.skipped = "climb", []
        self._start_window(self.theta_min)

    def _candidates(self, above: float) -> list[tuple[float, float, int]]:
        """The policy's candidate CFs above ``above``, up to theta_max, in order: each with the
        step size and window count the policy continues from after it."""
        out: list[tuple[float, float, int]] = []
        s, j, top = self.s, self.window_index, self.config.theta_max
        while True:
            want = self.theta_min * s
            cf = self.snap(min(want, top))
            s, j = self.policy.next(s, j + 1), j + 1
            if cf > above and (not out or cf > out[-1][0]):
                out.append((cf, s, j))
            if want >= top:
                return out

    def _next_candidate(self, cf: float) -> float | None:
        """The next CF to try above ``cf``: the policy's next candidate, skipping those that
        a higher candidate beats by the link model even at the lowest gain kept (``epsilon``)
        against their own highest (the last window's: gains fall as the CF rises); ``None``
        once no deliverable CF above ``cf`` is left."""
        candidates = self._candidates(cf)
        g, worst = self.worth(self.wgain.get(cf, 1.0)), self.worth(self.config.epsilon)
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
        policy's ``progress`` option says (:func:`gravac.control.window.predicted_progress`)."""
        return predicted_progress(gain, self.policy.progress)

    def kept_tput(self) -> dict[float, float]:
        """Compression throughput of every CF sent for a window whose gain kept epsilon."""
        eps = self.config.epsilon
        return {
            cf: self.tsys[cf] * self.worth(g)
            for cf, g in self.wgain.items()
            if g >= eps and cf in self.tsys
        }

    def _best(self) -> float:
        """The largest kept CF whose compression throughput is within omega of the largest:
        as soon at the target, for fewer bytes; dense if no CF was kept."""
        tput = self.kept_tput()
        if not tput:
            return _DENSE_CF
        floor = (1.0 - self.config.omega) * max(tput.values())
        return max(cf for cf, t in tput.items() if t >= floor)

    def predicted_tsys(self, cf: float) -> float | None:
        """System throughput at ``cf`` from the link model (:func:`link_seconds`), anchored at
        the largest CF sent for a window with its communication measured; ``None`` before
        one was, ``inf`` where the model predicts no cost at all."""
        measured = [c for c in self.comm if c in self.tsys and c != _DENSE_CF]
        if not measured:
            return None
        anchor = max(measured)
        seconds = link_seconds(cf, anchor, 1.0 / self.tsys[anchor], self.comm[anchor])
        return math.inf if seconds <= 0 else 1.0 / seconds

    def _worth_trying(self) -> bool:
        """Whether a CF above the current one may beat the best compression throughput by
        more than omega: the link model's throughput at theta_max times the last gain."""
        best = self.kept_tput()
        predicted = self.predicted_tsys(self.config.theta_max)
        g = self.wgain.get(self.current)
        if not best or predicted is None or g is None:
            return True
        return predicted * self.worth(g) > (1.0 + self.config.omega) * max(best.values())

    def resnap(self) -> None:
        super().resnap()
        if self.current != _DENSE_CF:
            self.current = self.snap(self.current)
        self.wgain = {self.snap(cf): v for cf, v in sorted(self.wgain.items())}
        self.comm = {self.snap(cf): v for cf, v in sorted(self.comm.items())}
        self.skipped = sorted({self.snap(cf) for cf in self.skipped})

    def _settle(self, cf: float) -> None:
        self.theta_ideal = cf_key(cf)
        self.phase, self.mode, self.settled_windows = Phase.SETTLED, "climb", 0
        self._start_window(self.theta_ideal)

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "current": self.current,
            "awaiting": self.awaiting,
            "wgain": sorted(self.wgain.items()),
            "samples": list(self._samples),
            "comm": sorted(self.comm.items()),
            "comm_samples": list(self._comm_samples),
            "mode": self.mode,
            "skipped": list(self.skipped),
            "settled_windows": self.settled_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.current = float(state["current"])
        self.awaiting = bool(state["awaiting"])
        self.wgain = {float(k): float(v) for k, v in state["wgain"]}
        self._samples = [float(v) for v in state["samples"]]
        self.comm = {float(k): float(v) for k, v in state["comm"]}
        self._comm_samples = [float(v) for v in state["comm_samples"]]
        if state["mode"] not in _MODES:
            raise ValueError(
                f"the checkpoint's search mode must be one of {_MODES}, got {state['mode']!r}"
            )
        self.mode = str(state["mode"])
        self.skipped = [float(v) for v in state["skipped"]]
        self.settled_windows = int(state["settled_windows"])
        self._window_gain = None
