"""The search by shadow: every candidate CF judged on the same steps, none of them sent to try it.

The search by trial (:mod:`gravac.control.searches.trial`) sends each candidate CF for a window to
measure its window gain, so it spends its first windows, while the model learns fastest, at the CFs
it passes through (``docs/studies/2026-12-01-search-by-shadow.md``). Here the window gain of every
CF of the ladder (``theta_min`` and the policy's candidates ``theta_min * s`` up to ``theta_max``)
is measured at every window by replaying error feedback on a sample of the gradient
(:mod:`gravac.control.replay`), and the system throughput of a CF not sent comes from the CFs timed
around it or the link model (:func:`gravac.control.link.between_seconds`,
:func:`gravac.control.link.link_seconds`)::

    warm-up:  send theta_min for warmup_steps (ended after MIN_WARMUP_STEPS on a slow link, as
              the search by trial's), except at its first, third, fifth and seventh steps
              (the last two where the warm-up is long enough) and, when the link model
              ended it early, at its bridge step: these send the top of the ladder
    each window's end, with the shadow window gains shadow[cf] of every cf of the ladder:
        judged[cf] = 1 - (1 - (shadow[cf] - excess[cf])) * share, where excess[cf] is how
                     far cf's shadow gain exceeded its real window gain the last time cf was
                     sent (0 before), and share the largest signal share of a window's
                     gradient measured so far, at least MIN_SIGNAL_SHARE (1 before; the
                     option ``noise``)
        tsys[cf] = the median samples/s measured the last time cf was sent; else, between
                   the largest CF below it that was sent and the smallest above it that was
                   sent or is the top of the ladder timed in the warm-up, linear in the bytes;
                   else the link model from the largest CF sent below it (the smallest above,
                   if none is below)
        tput[cf] = tsys[cf] * p(judged[cf]), for cf with judged[cf] >= epsilon
        keep the CF sent if its tput is within omega of the largest; else send for the next
        window the largest cf whose tput is within omega of the largest (as fast to the
        target, for fewer bytes; the smallest with the option prefer="gain",
        :data:`gravac.control.options.PREFERENCES`); dense if no cf keeps epsilon
    where p(g) is the progress per step a gain predicts, as in the search by trial (the policy
    option ``progress``: by default the gain itself,
    :func:`gravac.control.window.predicted_progress`)

The link model needs one step's time at ``theta_min``, the most expensive CF on a slow link; the
warm-up's other steps cost more there than they tell. So the steps whose time the link model
does not read send the top of the ladder (:data:`TOP_WARMUP_STEPS`): the first, whose time
carries the run's one-off costs and is not kept, the third, sent before the second's time is
agreed, the fifth and seventh, which time the top twice more, and the bridge of a warm-up the
link model ended. On a fast link the warm-up goes on at ``theta_min`` after them, as before.
The warm-up then sent two CFs: its real window gain is no CF's own, and corrects no shadow
(``docs/studies/2026-12-02-warmup-top.md``).

A step's time at a CF not sent is more than its communication scaled by the bytes: on the CPU
compression grows with the elements kept, and the link model, which keeps all but the
communication, would time every CF as the one it was anchored at, so on loopback the search
kept sending a low CF (``docs/studies/2026-12-02-between-timing.md``). The warm-up's steps at the
top of the ladder time its step as well (the median of those timed: the engine times a step
from the end of the one before to its own end, and counts it at its CF), and a CF between two
CFs timed is timed between them, linear in ``1 / cf``; the top's time is held to the link
model's, which a noisy step would exceed.

The CF sent changes only for one better by more than omega: without that, the search moved back
and forth between CFs from window to window. And the shadow of a high CF is optimistic: replayed
while a lower CF trains the model, it does not see the slower training the CF itself brings, so
the real window gain of the CF sent corrects its shadow from then on (``excess``;
``docs/studies/2026-12-01-search-by-shadow.md``).

The gains' horizon (the option ``horizon``, windows; 2 by default) may be longer than
the interval between decisions: with ``horizon = h`` each window's end judges the gains over it
and the ``h - 1`` windows before it (the sums ``S`` of those windows kept,
:meth:`gravac.control.replay.ShadowSums.clear`), shadows and the CF sent alike. A window gain grows
with its horizon at a high CF, whose residual is delivered steps later
(``docs/studies/2026-12-01-window-horizon.md``), so a longer horizon judges high CFs over more of
what error feedback delivers without deciding less often. The real gain of a CF sent then spans the
CFs sent before it until it was sent for ``h`` windows in a row, so it corrects the CF's shadow only
from then on (``excess``).

What error feedback holds back is noise as well as signal, and held-back noise costs no
progress. So the held-back part of a gain counts by the signal share of a window's gradient
(:mod:`gravac.control.noise`, from how the ranks' window sums agree; the option ``noise``, on
by default): the largest share measured so far, the workload's at its start, not the current one,
which falls late in training even where higher CFs still cost progress
(``docs/studies/2026-12-02-signal-share.md``), and at least :data:`MIN_SIGNAL_SHARE`: at most
half of what was held back counts as noise, however low one early estimate came out.

The search reads window gains, so the per-step gain of the CF sent (a pass over the gradient for
its norm) is measured only at the step that carries a window's gain, where it is logged beside
it; the shadows are replayed while the step's collectives travel
(:meth:`gravac.engine.Engine.close`).

Every decision reads only values agreed over ranks (the shadow terms are summed over ranks with
the step's scalars, as the window's are), so the ranks decide alike. It needs a compressor whose
sends a sample can replay (:class:`gravac.compressors.Replayable`) and plain error
feedback; the engine says so otherwise.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from gravac.control.link import between_seconds, link_seconds
from gravac.control.noise import signal_gain
from gravac.control.options import DEFAULT_HORIZON
from gravac.control.records import DENSE, Decision, Observation, Phase, Plan, Report, Skipped
from gravac.control.searches.common import DENSE_CF, Setting, ladder, within_omega
from gravac.control.searches.sent import MIN_WARMUP_STEPS, SentWindows
from gravac.control.tables import cf_key
from gravac.control.window import predicted_progress

__all__ = ["MIN_SIGNAL_SHARE", "TOP_WARMUP_STEPS", "ShadowController"]

#: the warm-up steps (counted from 0) that send the top of the ladder where the warm-up is long
#: enough for the link model to end it (MIN_WARMUP_STEPS): the first, which is never timed (no
#: step ended before it) and carries the run's one-off costs, the third, sent before the
#: second's time is agreed (so on a slow link one warm-up step of four sends theta_min, not
#: four), and the fifth and seventh, each one more time of the top's step: one step timed the
#: top of vgg-digits on loopback at 49-81 ms against a real 55 ms, enough to keep theta_min by
#: the omega rule (``docs/studies/2026-12-07-warmup-trajectory.md``); the median of three is
#: what the search reads. A top step is sent only where its time is agreed before the warm-up's
#: last step (:meth:`ShadowController.top_steps`)
TOP_WARMUP_STEPS = (0, 2, 4, 6)
#: the least share of signal the search counts in what error feedback held back
#: (:func:`gravac.control.noise.signal_gain`): so at most half of it is taken for noise. The
#: share is estimated from the ranks' agreement, and on 2 ranks one low estimate at the start
#: stands for the whole run (the largest so far): on one seed of 36 of vgg-digits on loopback
#: the largest was 0.23 (0.46-0.80 on the others), its CF 1000's real window gains of
#: 0.31-0.51 were judged 0.84-0.89, and the run held CF 1000 for seven windows without reaching
#: the bar (``docs/studies/2026-12-07-warmup-trajectory.md``)
MIN_SIGNAL_SHARE = 0.5

#: what a choice compares, by CF ascending: (cf, judged gain, estimated samples per second)
Table = tuple[tuple[float, float, float], ...]


class ShadowController:
    """The search by shadow, the module docstring's: what ``search="shadow"`` runs, and
    ``"auto"`` where the compressor's sends can be replayed. Its ``setting`` must hold an
    adaptive ladder."""

    def __init__(self, setting: Setting) -> None:
        setting.adaptive("the search by shadow")
        self.config, self.policy, self.snap = setting.config, setting.policy, setting.snap
        self.windows = SentWindows(setting)  # the window sent, what windows measured
        self.ladder = self._ladder()  # the CFs whose window gains are measured, ascending
        self.shadow_gain: dict[float, float] = {}  # the last window's, by CF
        self.excess: dict[float, float] = {}  # shadow less real window gain, when last sent
        self._shadow: dict[float, float] = {}  # this step's agreed shadow gains, if any
        self.windows_closed = 0  # windows ended so far, the warm-up included
        self.same_windows = 0  # of them, the last ones in a row that sent the same CF
        self.last_sent: float | None = None  # the CF the last window that ended sent
        self.signal_share: float | None = None  # the largest signal share measured so far
        self._top_samples: list[float] = []  # seconds/sample of the warm-up's top steps timed
        self.top_seconds: float | None = None  # seconds/sample at the top, the warm-up's

    @property
    def phase(self) -> str:
        """Warm-up, search or settled (:class:`gravac.control.records.Phase`)."""
        return self.windows.phase.value

    @property
    def horizon(self) -> int:
        """Windows its gains span: the config's ``horizon``, or :data:`DEFAULT_HORIZON`."""
        return DEFAULT_HORIZON if self.config.horizon is None else self.config.horizon

    @property
    def discounts_noise(self) -> bool:
        """Whether held-back energy counts by its signal share: the config's ``noise``, on
        unless it says ``False``."""
        return self.config.noise is not False

    def _ladder(self) -> tuple[float, ...]:
        """``theta_min`` and the policy's candidates above it, up to ``theta_max``."""
        top, m = self.config.theta_max, self.windows.theta_min
        return (m, *(cf for cf, _, _ in ladder(self.policy, m, top, self.snap, above=m)))

    @property
    def probes_warmup(self) -> bool:
        """Whether the warm-up sends the top of the ladder at some of its steps: it is long
        enough for the link model to end it (:data:`TOP_WARMUP_STEPS`)."""
        return (
            self.config.warmup_steps >= MIN_WARMUP_STEPS
            and self.ladder[-1] > self.windows.theta_min
        )

    @property
    def in_probing_warmup(self) -> bool:
        """Whether the window open is a warm-up that sends the top of the ladder at some of its
        steps (:attr:`probes_warmup`): its times and real gain are two CFs'."""
        return self.windows_closed == 0 and self.probes_warmup

    @property
    def top_steps(self) -> tuple[int, ...]:
        """The warm-up steps that send the top of the ladder (:data:`TOP_WARMUP_STEPS`): the
        first two always (a slow link's warm-up may end after them), a later one only where
        its time, agreed at the step after it, comes before the warm-up's last step."""
        last = self.config.warmup_steps - 2
        return tuple(k for i, k in enumerate(TOP_WARMUP_STEPS) if i < 2 or k <= last)

    def sends_top(self) -> bool:
        """Whether this step is one of the warm-up's that send the top of the ladder
        (:attr:`top_steps`), or the bridge of a warm-up the link model ended early."""
        if not self.in_probing_warmup:
            return False
        if self.windows.phase is Phase.WARMUP:
            return self.windows.step in self.top_steps
        return self.windows.awaiting and self.windows.step < self.config.warmup_steps

    # ----------------------------------------------------------------- per step
    def plan(self) -> Plan:
        """Send the window's CF (the top at some warm-up steps), measure every CF of the
        ladder's shadow window gains."""
        current = self.windows.current
        if self.sends_top():
            sent, send = self.ladder[-1], Decision(cf=self.ladder[-1], which="min")
        elif current == DENSE_CF:
            sent, send = self.windows.theta_min, DENSE
        else:
            sent, send = current, Decision(cf=current, which="min")
        return Plan(
            sent,
            send,
            measure=self.windows.awaiting,
            window_terms=self.windows.awaiting,
            shadows=self.ladder,
            signal=self.discounts_noise,
            horizon=self.horizon,
        )

    def observe(self, seen: Observation | Skipped) -> Report:
        """Fold a step's agreed values; a window that closes with it is judged."""
        if isinstance(seen, Skipped):
            self.windows.discard()
            self._shadow = {}
            return Report(self.phase)
        t = seen.throughput
        if t is not None and self.in_probing_warmup and cf_key(t.cf) == self.ladder[-1]:
            self._top_samples.append(1.0 / t.value)
        if seen.signal_share is not None:
            old = self.signal_share
            self.signal_share = seen.signal_share if old is None else max(old, seen.signal_share)
        if seen.plan.window_terms and seen.shadow_gains:
            self._shadow = {
                cf_key(cf): g for cf, g in seen.shadow_gains.items() if math.isfinite(g)
            }
        report, closes = self.windows.observe(seen, lambda: self.ladder[1:])
        if closes:
            return dataclasses.replace(report, judged=self._end_window())
        return report

    def _top_seconds(self) -> float | None:
        """Seconds per sample at the top of the ladder from the warm-up (called once
        theta_min's window is closed): the median of its top steps timed, at most what the
        link model gives it from theta_min: a higher CF compresses no more slowly, so a longer
        time comes from a step slowed by something else, and would put every CF between at
        theta_min's time or above for the rest of the run (none of them sent, none timed
        again). ``None`` where no top step was timed (a resume, a skipped step)."""
        top, m = self.ladder[-1], self.windows.theta_min
        w = self.windows
        if not self._top_samples or m not in w.smoothed.tsys or m not in w.comm:
            return None
        bound = link_seconds(top, m, 1.0 / w.smoothed.tsys[m], w.comm[m])
        return min(statistics.median(self._top_samples), bound)

    def _end_window(self) -> Table:
        """Close the window, fold what it measured and choose the next window's CF; returns
        the table the choice compared (:meth:`judged_table`)."""
        cf, g = self.windows.close()
        mixed = self.in_probing_warmup  # the warm-up sent two CFs
        if mixed:
            self.top_seconds = self._top_seconds()
            self._top_samples = []
        self.windows_closed += 1
        self.same_windows = self.same_windows + 1 if cf == self.last_sent else 1
        self.last_sent = None if mixed else cf
        # the real gain spans the horizon's windows, as the shadows' do: it is the CF's own
        # only if that CF was sent in all of them
        own = not mixed and self.same_windows >= min(self.horizon, self.windows_closed)
        if own and g is not None and cf != DENSE_CF:
            self.windows.wgain[cf] = g  # the real window gain of the CF sent
        real = self.windows.gain_now
        if own and real is not None and math.isfinite(real) and cf in self._shadow:
            self.excess[cf] = self._shadow[cf] - real
        if self._shadow:
            self.shadow_gain, self._shadow = self._shadow, {}
        table = self.judged_table()
        self.windows.settle(self._choose(table))
        return table

    def estimated_tsys(self, cf: float) -> float | None:
        """System throughput at ``cf``: measured, or between the nearest CFs timed below and
        above it (:func:`gravac.control.link.between_seconds`; the top of the ladder is timed in
        the warm-up), or the link model from the nearest CF sent (see the module docstring);
        ``None`` before any CF was measured."""
        sent = sorted(
            c for c in self.windows.comm if c in self.windows.smoothed.tsys and c != DENSE_CF
        )
        if cf in sent:
            return self.windows.smoothed.tsys[cf]
        if not sent:
            return None
        timed = {c: 1.0 / self.windows.smoothed.tsys[c] for c in sent}
        if self.top_seconds is not None:
            timed.setdefault(self.ladder[-1], self.top_seconds)
        if cf in timed:
            return 1.0 / timed[cf]
        below = [c for c in sent if c < cf]
        above = sorted(c for c in timed if c > cf)
        if below and above:
            lo, hi = below[-1], above[0]
            seconds = between_seconds(cf, lo, timed[lo], hi, timed[hi])
        else:
            anchor = below[-1] if below else sent[0]
            seconds = link_seconds(cf, anchor, timed[anchor], self.windows.comm[anchor])
        return math.inf if seconds <= 0 else 1.0 / seconds

    def judged_gain(self, cf: float) -> float | None:
        """``cf``'s last shadow window gain, less its excess over the real one, its held-back
        part counted by the signal share (see the module docstring); ``None`` before one was
        measured."""
        g = self.shadow_gain.get(cf)
        if g is None:
            return None
        g -= self.excess.get(cf, 0.0)
        share = self.signal_share
        if share is None or not self.discounts_noise:
            return g
        return signal_gain(g, max(share, MIN_SIGNAL_SHARE))

    def judged_table(self) -> Table:
        """What :meth:`_choose` compares, by CF ascending:
        ``(cf, judged gain, estimated samples per second)``, NaN where either is not known yet
        (logged as :attr:`gravac.control.records.Report.judged`)."""
        rows = []
        for cf in sorted(self.shadow_gain):
            g, t = self.judged_gain(cf), self.estimated_tsys(cf)
            rows.append((cf, math.nan if g is None else g, math.nan if t is None else t))
        return tuple(rows)

    def shadow_tput(self, table: Table | None = None) -> dict[float, float]:
        """Compression throughput, ``tsys * p(gain)`` by ``table`` (``None``: the
        :meth:`judged_table` now), of every CF of the ladder whose judged gain keeps epsilon
        and whose system throughput is estimated."""
        eps = self.config.epsilon
        return {
            cf: t * self.worth(g)
            for cf, g, t in (self.judged_table() if table is None else table)
            if g >= eps and not math.isnan(t)
        }

    def _choose(self, table: Table) -> float:
        """The CF sent if its compression throughput by ``table`` (:meth:`judged_table`) is
        within omega of the largest, else the largest CF that is (the smallest,
        ``prefer="gain"``); dense if no CF keeps epsilon."""
        tput = self.shadow_tput(table)
        if not tput:
            return DENSE_CF
        top = max(tput.values())
        if math.isinf(top):  # as fast as anything can be: only the infinite ones are as good
            return within_omega(tput, 0.0, self.config.preference)
        if tput.get(self.windows.current, -math.inf) >= (1.0 - self.config.omega) * top:
            return self.windows.current
        return within_omega(tput, self.config.omega, self.config.preference)

    def worth(self, gain: float) -> float:
        """The fraction of a dense step's progress that a window ``gain`` predicts, as the
        config's ``progress`` says (:func:`gravac.control.window.predicted_progress`)."""
        return predicted_progress(gain, self.config.progress_measure)

    def resnap(self) -> None:
        """Snap every CF held again, after the deliverable CFs changed (the compressor was
        bound to a new layout)."""
        self.windows.resnap()
        self.ladder = self._ladder()
        if self.last_sent not in (None, DENSE_CF):
            self.last_sent = self.snap(self.last_sent)
        self.shadow_gain = {self.snap(cf): v for cf, v in sorted(self.shadow_gain.items())}
        self.excess = {self.snap(cf): v for cf, v in sorted(self.excess.items())}

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values)."""
        return {
            **self.windows.state_dict(),
            "shadow_gain": sorted(self.shadow_gain.items()),
            "excess": sorted(self.excess.items()),
            "windows_closed": self.windows_closed,
            "same_windows": self.same_windows,
            "last_sent": self.last_sent,
            "signal_share": self.signal_share,
            "top_samples": list(self._top_samples),
            "top_seconds": self.top_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a search by shadow's state, or adopt a search by trial's (a checkpoint from
        before ``search="auto"`` made this search the default): its measured throughputs and
        window gains carry over, and the shadows' gains come from the next window's end.

        Raises:
            ValueError: the saved ``theta_min`` lies outside this controller's CF range.
        """
        self.windows.load_state_dict(state)
        self.shadow_gain = {float(k): float(v) for k, v in state.get("shadow_gain", [])}
        self.excess = {float(k): float(v) for k, v in state.get("excess", [])}
        self._shadow = {}
        self.windows_closed = int(state.get("windows_closed", 0))
        self.same_windows = int(state.get("same_windows", 0))
        last = state.get("last_sent")
        self.last_sent = None if last is None else float(last)
        share = state.get("signal_share")
        self.signal_share = None if share is None else float(share)
        self._top_samples = [float(v) for v in state.get("top_samples", [])]
        top = state.get("top_seconds")
        self.top_seconds = None if top is None else float(top)
