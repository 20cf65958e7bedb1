"""The GraVAC controller: which CF to evaluate and which to send (GraVAC Algorithm 1).

Tyagi and Swany, "GraVAC: Adaptive Compression for Communication-Efficient Distributed DL
Training", IEEE CLOUD 2023, Algorithm 1, as docs/design.md section 9.1 states it. Every step the
engine compresses at ``theta_min`` and, outside warm-up, at a candidate
``theta_c = min(theta_min * s, theta_max)``; the controller chooses what to send::

    warm-up:                          send theta_min
    gain[theta_c]   >= epsilon:       send theta_c
    gain[theta_min] >= epsilon:       send theta_min
    otherwise:                        send dense (CF 1) and reset the residuals

where ``gain[.]`` are EWMAs of the compression gain (:mod:`gravac.gain`). It keeps the system
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

Call protocol, per step t (deciding and observing are separate, so that the decision is known
before the step's gradients exist and its own values are agreed while its payloads travel)::

    plan = c.plan(); decision = c.decide(plan)      # from values agreed through step t - 1
    ... compress at the plan's CFs, send what the decision names, agree step t's values ...
    c.record_throughput(cf sent at t - 1, samples / agreed step time)   # when measured
    c.observe(plan, gain_min_t, gain_candidate_t)
    c.end_step()                                    # window and search rules

A step skipped on every rank (non-finite values) makes none of the calls after ``decide`` but
``discard_step()``. Controllers that read more than the gains (Accordion's per-layer regimes,
:mod:`gravac.control.accordion`) also get, around these calls: ``note_lr(lr)`` before ``plan``,
``track(layers, g, numels)`` with each compressed unit's uncompressed gradient at launch,
``local_values()`` (sent with the step's scalars) and ``observe_values(table)`` (every rank's
row of them) before ``observe``; here they do nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Literal

from torch import Tensor

from gravac.checks import check_cf, is_integer, is_real
from gravac.control.policies.base import ScalingPolicy

__all__ = ["Controller", "ControllerConfig", "Decision", "Phase", "Plan", "cf_key", "ewma"]

#: EWMA smoothing per worker: alpha = min(1, N * _ALPHA_PER_WORKER), the paper's N / 100.
_ALPHA_PER_WORKER = 0.01
#: digits CF keys are rounded to, so that theta_min * s computed twice names one table entry
_CF_DIGITS = 9


def ewma(old: float | None, new: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first sample is taken as it is."""
    return new if old is None else (1.0 - alpha) * old + alpha * new


def cf_key(cf: float) -> float:
    """The table key of a CF (rounded, so that one CF computed twice names one entry)."""
    return round(cf, _CF_DIGITS)


def _identity(cf: float) -> float:
    return cf


@dataclass(frozen=True)
class ControllerConfig:
    """Hyperparameters of Algorithm 1.

    Attributes:
        theta_min: the lowest CF ever sent compressed (it may escalate during training).
        theta_max: the highest CF the search may reach.
        epsilon: minimum gain for a compressed CF to be sent (Algorithm 1: smoothed per-step
            gain) or kept (the search by trial: window gain).
        omega: relative tolerance for "gains close enough to escalate theta_min" and for
            "compression throughput saturated" (the trial search: "as good").
        window: steps each candidate CF is evaluated for.
        warmup_steps: steps at theta_min before the search starts (the trial search: theta_min's
            window).
        ewma_alpha: gain and throughput smoothing; ``None`` picks ``min(1, N / 100)``.

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
    (:mod:`gravac.control.shadow_search`).
    """

    theta_min: float = 10.0
    theta_max: float = 1000.0
    epsilon: float = 0.5
    omega: float = 0.1
    window: int = 25
    warmup_steps: int = 10
    ewma_alpha: float | None = None

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

    def alpha(self, world_size: int) -> float:
        """The EWMA factor for ``world_size`` workers."""
        if self.ewma_alpha is not None:
            return float(self.ewma_alpha)
        return min(1.0, world_size * _ALPHA_PER_WORKER)


class Phase(str, Enum):
    """Where the controller is: warm-up, searching, settled on theta_ideal, or pinned."""

    WARMUP = "warmup"
    SEARCH = "search"
    SETTLED = "settled"
    FIXED = "fixed"
    ACCORDION = "accordion"


@dataclass(frozen=True)
class Plan:
    """What to compress this step: always at ``theta_min``; at ``candidate`` too when set.

    ``measure``: whether the step's gains are wanted (not under a fixed CF, whose decisions
    never read them: the engine then skips the gain terms).
    ``layer_cfs``: CFs by layer (a tensor's stable id, :attr:`gravac.engine.Unit.layers`),
    sent instead of ``theta_min``; other layers use ``theta_min``. ``per_layer``: the plan
    decides per layer (Accordion's), so the CF sent is reported as the one achieved.
    ``window_terms``: the step carries the gain of the window that ended before it
    (:mod:`gravac.control.window`), and starts the next window.
    ``shadows``: CFs whose window gains are measured without sending them
    (:mod:`gravac.control.replay`), at every step of every window.
    ``signal``: the step that carries the window's gain also measures the signal share of the
    window's gradient over ranks (:mod:`gravac.control.noise`).
    """

    theta_min: float
    candidate: float | None
    measure: bool = True
    layer_cfs: Mapping[int, float] = field(default_factory=dict)
    per_layer: bool = False
    window_terms: bool = False
    shadows: tuple[float, ...] = ()
    signal: bool = False

    def cfs_for(self, layers: tuple[int, ...]) -> tuple[float, ...]:
        """The CF of each of ``layers``."""
        return tuple(self.layer_cfs.get(k, self.theta_min) for k in layers)


@dataclass(frozen=True)
class Decision:
    """What to send this step: ``cf`` (1.0 for dense) and which compression produced it."""

    cf: float
    which: Literal["candidate", "min", "dense"]


class Controller:
    """State machine of Algorithm 1; see the module docstring.

    Args:
        config: the hyperparameters.
        policy: the scaling policy; one with a ``static_cf`` pins the CF (no search).
        world_size: number of workers (sets the default EWMA factor).
        snap: the compressor's nearest deliverable CF to a requested one
            (:meth:`gravac.compressors.Compressor.deliverable_cf`); every CF the controller
            plans, keys its tables by and decides is a snapped one. ``None``: every CF.
    """

    #: :meth:`track` reads each unit's gradient alone (before error feedback adds to it)
    tracks_gradients: bool = False
    #: its plans ask for shadow window gains (:attr:`Plan.shadows`)
    plans_shadows: bool = False

    def __init__(
        self,
        config: ControllerConfig,
        policy: ScalingPolicy,
        world_size: int,
        snap: Callable[[float], float] | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.alpha = config.alpha(world_size)
        self._snap = snap if snap is not None else _identity
        self.theta_min = self.snap(config.theta_min)
        self.s = policy.first()
        self.theta_ideal: float | None = None
        self.window_index = 0  # search windows completed
        self.window_step = 0  # steps into the current window (or warm-up)
        self.gain: dict[float, float] = {}
        self.tsys: dict[float, float] = {}
        # steps since the last window gain was measured (here it is only logged)
        self.window_clock = 0
        if policy.static_cf is not None:
            self.phase = Phase.FIXED
        elif config.warmup_steps > 0:
            self.phase = Phase.WARMUP
        else:
            self.phase = Phase.SEARCH

    @property
    def horizon(self) -> int:
        """Windows a window gain spans: one, but for the search by shadow
        (:func:`gravac.control.policies.base.check_horizon`)."""
        return 1

    # ----------------------------------------------------------------- per step
    def snap(self, cf: float) -> float:
        """The deliverable CF nearest ``cf``, as a table key."""
        return cf_key(self._snap(cf))

    def resnap(self) -> None:
        """Snap every CF held again, after the deliverable CFs changed (the compressor was
        bound to a new layout): ``theta_min``, ``theta_ideal`` and the table keys (where two
        keys meet, the larger CF's entry is kept)."""
        self.theta_min = self.snap(self.theta_min)
        if self.theta_ideal is not None:
            self.theta_ideal = self.snap(self.theta_ideal)
        self.gain = {self.snap(cf): v for cf, v in sorted(self.gain.items())}
        self.tsys = {self.snap(cf): v for cf, v in sorted(self.tsys.items())}

    @property
    def theta_c(self) -> float:
        """The candidate CF: ``min(theta_min * s, theta_max)`` (theta_ideal once settled)."""
        if self.phase is Phase.SETTLED and self.theta_ideal is not None:
            return self.theta_ideal
        return self.snap(min(self.theta_min * self.s, self.config.theta_max))

    def note_lr(self, lr: float | None) -> None:
        """The wrapped optimizer's learning rate at the start of a step (``None``: unknown)."""

    def track(self, layers: tuple[int, ...], grad: Tensor, numels: tuple[int, ...]) -> None:
        """A unit's flat uncompressed local gradient of this step: the tensors ``layers``
        (stable ids) of ``numels`` elements (read it now: it changes at commit)."""

    def local_values(self) -> list[float]:
        """This rank's values to agree with the step's scalars (none here)."""
        return []

    def observe_values(self, table: Tensor) -> None:
        """Every rank's :meth:`local_values` (one row each), agreed at a step not skipped."""

    def discard_step(self) -> None:
        """The step is skipped on every rank: forget what :meth:`track` saw of it."""

    def plan(self) -> Plan:
        """The CFs to compress at this step."""
        static = self.policy.static_cf
        due = self.window_clock >= self.config.window
        if static is not None:
            measure = self.policy.measure
            return Plan(self.snap(static), candidate=None, measure=measure, window_terms=due)
        if self.phase is Phase.WARMUP or self.theta_c <= self.theta_min:
            return Plan(theta_min=self.theta_min, candidate=None, window_terms=due)
        return Plan(theta_min=self.theta_min, candidate=self.theta_c, window_terms=due)

    def decide(self, plan: Plan) -> Decision:
        """What to send at the step ``plan`` was made for, from the gains agreed before it.

        The decision at step t reads the EWMAs through step t - 1 (docs/design.md section 8), so
        that it is known before step t's gradients exist and each bucket can be sent as soon as it
        is ready; step t's own gains reach :meth:`observe` afterwards. A CF without a smoothed
        gain yet is not sent, except ``theta_min``, which is sent until its gain is known (as
        in warm-up): a new candidate is first measured, then sent from its next step on.
        """
        if self.phase in (Phase.FIXED, Phase.WARMUP):
            return Decision(cf=plan.theta_min, which="min")
        eps = self.config.epsilon
        g_c = None if plan.candidate is None else self.gain.get(cf_key(plan.candidate))
        if plan.candidate is not None and g_c is not None and g_c >= eps:
            return Decision(cf=plan.candidate, which="candidate")
        g_min = self.gain.get(cf_key(plan.theta_min))
        if g_min is None or g_min >= eps:
            return Decision(cf=plan.theta_min, which="min")
        return Decision(cf=1.0, which="dense")

    def observe(self, plan: Plan, gain_min: float, gain_candidate: float | None) -> None:
        """Fold one step's agreed gains (at the CFs of its ``plan``) into the EWMAs (a plan
        that measures nothing has none to fold)."""
        if not plan.measure:
            return
        self._update_gain(plan.theta_min, gain_min)
        if plan.candidate is not None:
            if gain_candidate is None:
                raise ValueError(f"a gain for candidate CF {plan.candidate} is required")
            self._update_gain(plan.candidate, gain_candidate)

    def observe_window(self, plan: Plan, gain: float) -> None:
        """The agreed gain of the window that ended before the step of ``plan`` (NaN if it
        could not be measured); a new window starts. Algorithm 1 does not read it (the engine
        logs it)."""
        self.window_clock = 0

    def observe_signal(self, share: float | None) -> None:
        """The agreed signal share of the window that ended before the step of a plan with
        ``signal`` (:func:`gravac.control.noise.signal_fraction`; ``None``: not measurable); called
        before :meth:`observe_window`. Only a controller that plans it reads it."""

    def observe_shadows(self, plan: Plan, gains: Mapping[float, float]) -> None:
        """The agreed window gains of the CFs of ``plan.shadows`` (:mod:`gravac.control.replay`),
        for the window that ended before the step of ``plan``; called after :meth:`observe_window`.
        Only a controller that plans shadows reads them."""

    def smoothed_gain(self, cf: float) -> float | None:
        """The EWMA gain of ``cf`` (1 for dense), ``None`` before its first sample."""
        return 1.0 if cf == 1.0 else self.gain.get(cf_key(cf))

    def record_throughput(self, cf: float, samples_per_second: float) -> None:
        """Fold an agreed system-throughput sample measured while sending at ``cf``."""
        if not math.isfinite(samples_per_second) or samples_per_second <= 0:
            raise ValueError(f"samples_per_second must be finite and > 0, got {samples_per_second}")
        k = cf_key(cf)
        self.tsys[k] = ewma(self.tsys.get(k), samples_per_second, self.alpha)

    def record_comm(self, cf: float, seconds_per_sample: float) -> None:
        """An agreed sample of the communication a step waited for while sending at ``cf``
        (beyond what backward hid), per sample; Algorithm 1 does not read it."""

    def tput(self) -> dict[float, float]:
        """Compression throughput ``tsys[cf] * gain[cf]`` of every CF with both known."""
        gains = {**self.gain, 1.0: 1.0}
        return {cf: t * gains[cf] for cf, t in self.tsys.items() if cf in gains}

    def end_step(self) -> None:
        """Advance the window; at a window's end apply the search rules."""
        self.window_clock += 1
        if self.phase is Phase.FIXED:
            return
        self.window_step += 1
        if self.phase is Phase.WARMUP:
            if self.window_step >= self.config.warmup_steps:
                self.phase = Phase.SEARCH
                self.window_step = 0
            return
        if self.window_step < self.config.window:
            return
        self.window_step = 0
        if self.phase is Phase.SEARCH:
            self._end_search_window()
        elif self.theta_ideal is not None:
            g = self.gain.get(cf_key(self.theta_ideal))
            if g is not None and g < self.config.epsilon:
                self.phase = Phase.SEARCH
                self.theta_ideal = None

    # ----------------------------------------------------------------- windows
    def _update_gain(self, cf: float, g: float) -> None:
        k = cf_key(cf)
        self.gain[k] = ewma(self.gain.get(k), g, self.alpha)

    def _end_search_window(self) -> None:
        self.window_index += 1
        theta_c = self.theta_c
        omega = self.config.omega
        g_min = self.gain.get(cf_key(self.theta_min))
        g_c = self.gain.get(theta_c)
        close = g_min is not None and g_c is not None and abs(g_c - g_min) <= omega * g_min
        if theta_c > self.theta_min and close:
            self.theta_min = theta_c
        if self.snap(self.config.theta_max) <= self.theta_min:  # no higher CF can be delivered
            self._settle(self.theta_min)
            return
        ranked = sorted(self.tput().items(), key=lambda kv: (-kv[1], kv[0]))
        if len(ranked) >= 2 and ranked[0][1] - ranked[1][1] <= omega * ranked[0][1]:
            self._settle(min(ranked[0][0], ranked[1][0]))
        elif theta_c >= self.config.theta_max and ranked:
            self._settle(ranked[0][0])
        else:
            self.s = self.policy.next(self.s, self.window_index)

    def _settle(self, cf: float) -> None:
        self.theta_ideal = cf_key(max(cf, self.theta_min))
        self.phase = Phase.SETTLED

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values)."""
        return {
            "config": asdict(self.config),
            "theta_min": self.theta_min,
            "s": self.s,
            "phase": self.phase.value,
            "theta_ideal": self.theta_ideal,
            "window_index": self.window_index,
            "window_step": self.window_step,
            "gain": sorted(self.gain.items()),
            "tsys": sorted(self.tsys.items()),
            "window_clock": self.window_clock,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: the saved ``theta_min`` lies outside this controller's CF range.
        """
        theta_min = float(state["theta_min"])
        lo, hi = self.snap(self.config.theta_min), self.config.theta_max
        if not lo <= theta_min <= hi:
            raise ValueError(
                f"the checkpoint's theta_min {theta_min:g} is outside this optimizer's CF range "
                f"[theta_min={lo:g}, theta_max={hi:g}]"
            )
        self.theta_min = theta_min
        self.s = float(state["s"])
        self.phase = Phase(state["phase"])
        ideal = state["theta_ideal"]
        self.theta_ideal = None if ideal is None else float(ideal)
        self.window_index = int(state["window_index"])
        self.window_step = int(state["window_step"])
        self.gain = {float(k): float(v) for k, v in state["gain"]}
        self.tsys = {float(k): float(v) for k, v in state["tsys"]}
        self.window_clock = int(state.get("window_clock", 0))
