"""Accordion's controller: per-layer regimes from gradient norms (docs/design.md section 9.6).

Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
Identification", MLSys 2021; the policy and its options are
:class:`gravac.control.policies.AccordionPolicy`. Per *layer* (each compressed tensor, keyed by the
front end's stable id, taken in launch order, identical on every rank)::

    every step:   acc[layer] += g[layer]     (the uncompressed local gradient; the engine keeps
                                             the sums, gravac.control.norms)
    at the last step of each interval:
                  n[layer] = mean over ranks of ||acc[layer]||     (agreed with the step's scalars)
                  critical[layer] = no previous n, or |prev - n| / prev >= eta
                  prev = n; acc = 0
    each step sends every critical layer at low_cf, every other one at high_cf (with a
    compressor that sends at ranks, PowerSGD: at low_rank and high_rank).

A learning-rate decay (the rate below :data:`LR_DECAY_FRACTION` of the previous step's, on any
rank) makes every layer critical from the next step to the end of the interval. Decisions read
only values agreed with a step's scalars, so each step's CFs are known before its gradients
(docs/design.md section 8) and identical on every rank.

Two choices where the paper is silent: the norms are the mean over ranks of each rank's own
accumulated gradient (Accordion's code uses rank 0's); and a step skipped on every rank
(non-finite values) restarts the interval, since its gradients cannot be taken back out of the
sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from gravac.control.policies.accordion import AccordionPolicy
from gravac.control.records import Decision, Observation, Plan, Report, Skipped
from gravac.control.searches.common import Setting
from gravac.control.window import rekeyed

__all__ = ["LR_DECAY_FRACTION", "PHASE", "AccordionController", "is_critical"]

#: a learning rate below this fraction of the previous step's is a decay: the drop of a step
#: schedule (usually 10x); a cosine or linear schedule moves far less in one step
LR_DECAY_FRACTION = 0.9
#: the phase Accordion reports at every step
PHASE = "accordion"


def is_critical(previous: float, new: float, eta: float) -> bool:
    """Accordion's rule: ``|previous - new| / previous >= eta``; a zero ``previous`` norm is
    critical (Accordion's code gives it ratio 9)."""
    return previous <= 0.0 or abs(previous - new) / previous >= eta


def _each_rank(previous: tuple[float, ...] | None, ranks: int) -> tuple[float, ...]:
    """``previous`` learning rates for ``ranks`` ranks: a single one (an older checkpoint's)
    stands for every rank's; none or another count are unknown (NaN)."""
    if previous is not None and len(previous) == ranks:
        return previous
    return (previous[0] if previous is not None and len(previous) == 1 else math.nan,) * ranks


def decayed(previous: tuple[float, ...], lrs: tuple[float, ...]) -> bool:
    """Whether some rank's learning rate ``lrs`` fell below :data:`LR_DECAY_FRACTION` of its
    ``previous`` one (NaN: unknown, never a decay)."""
    return any(new < LR_DECAY_FRACTION * old for old, new in zip(previous, lrs, strict=True))


class AccordionController:
    """Runs :class:`gravac.control.policies.AccordionPolicy`; see the module docstring.
    Layers are keyed by the front end's stable ids (:attr:`gravac.engine.Unit.layer_ids`), so
    that a checkpoint resumes them whatever the units' keys.

    Args:
        setting: what it is made with (its policy: Accordion's settings; its config: only
            ``ewma_alpha``, for the logged throughput).

    Raises:
        ValueError: the policy is not Accordion's.
    """

    def __init__(self, setting: Setting) -> None:
        policy = setting.policy
        if not isinstance(policy, AccordionPolicy):
            raise ValueError(f"Accordion needs an AccordionPolicy, got {policy!r}")
        self.config, self.policy, self.snap = setting.config, policy, setting.snap
        self.smoothed = setting.smoothed()
        self.low = self.snap(policy.low_cf)  # sent by critical layers
        self.high = self.snap(policy.high_cf)  # sent by the others
        # with a compressor that sends at ranks: the ranks of the two regimes, in place of CFs
        self.ranks = (policy.low_rank, policy.high_rank) if setting.ranked else None
        self.window_step = 0  # steps into the interval
        self.window_index = 0  # intervals completed
        self._norms: dict[int, float] = {}  # layer -> the last interval's agreed norm
        self._critical: dict[int, bool] = {}  # layer -> its regime this interval
        self._lrs: tuple[float, ...] | None = None  # each rank's last known learning rate

    @property
    def phase(self) -> str:
        """Always :data:`PHASE`."""
        return PHASE

    def regimes(self) -> dict[int, bool]:
        """Each layer's regime this interval (``True``: critical, sent at ``low``); layers
        without a decision yet are sent at ``low``."""
        return dict(self._critical)

    # ----------------------------------------------------------------- per step
    def plan(self) -> Plan:
        """Each layer at its regime's CF (or rank); the gradients summed, and their norms sent
        at the interval's last step."""
        if self.ranks is None:
            cfs = {k: self.low if c else self.high for k, c in self._critical.items()}
            rank, ranks = None, {}
        else:
            low, high = self.ranks
            cfs, rank = {}, low
            ranks = {k: low if c else high for k, c in self._critical.items()}
        return Plan(
            self.low,
            Decision(cf=self.low, which="min"),
            measure=False,
            layer_cfs=cfs,
            per_layer=True,
            rank=rank,
            layer_ranks=ranks,
            norms=True,
            norms_due=self.window_step == self.policy.interval - 1,
        )

    def observe(self, seen: Observation | Skipped) -> Report:
        """A step's agreed learning rates and, at an interval's end, norms: the regimes of the
        next interval, or every layer critical after a learning-rate decay. A skipped step
        restarts the interval."""
        if isinstance(seen, Skipped):
            self.window_step = 0
            return Report(PHASE)
        self.smoothed.fold(seen)
        previous = _each_rank(self._lrs, len(seen.lrs))
        decay = decayed(previous, seen.lrs)
        if seen.lrs:  # an unknown rate keeps the last known one
            pairs = zip(previous, seen.lrs, strict=True)
            self._lrs = tuple(new if math.isfinite(new) else old for old, new in pairs)
        report = self.smoothed.report(PHASE, seen.plan)
        self.window_step += 1
        if self.window_step >= self.policy.interval:
            self.window_step = 0
            self.window_index += 1
            self._new_regimes(seen.layer_norms or {})
        if decay:
            self._critical = dict.fromkeys(self._critical, True)
        return report

    def _new_regimes(self, norms: Mapping[int, float]) -> None:
        """The rule at an interval's end, for the layers of ``norms`` (others are dropped)."""
        eta = self.policy.eta
        self._critical = {
            k: k not in self._norms or is_critical(self._norms[k], n, eta) for k, n in norms.items()
        }
        self._norms = dict(norms)

    def relayer(self, layers: Mapping[int, int]) -> None:
        """Move each layer's norm and regime to its new id (``layers``: old -> new)."""
        self._norms = rekeyed(self._norms, layers)
        self._critical = rekeyed(self._critical, layers)

    def resnap(self) -> None:
        """Snap the two CFs and the table keys again, after the deliverable CFs changed."""
        self.low = self.snap(self.policy.low_cf)
        self.high = self.snap(self.policy.high_cf)
        self.smoothed.resnap(self.snap)

    def rescale(self, factor: float) -> None:
        """The gradients' unit changed (a loss scale): the last interval's norms, which the
        next interval's are compared with, in the new unit."""
        self._norms = {k: v * factor for k, v in self._norms.items()}

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values)."""
        return {
            "config": asdict(self.config),
            "phase": PHASE,
            "window_step": self.window_step,
            "window_index": self.window_index,
            **self.smoothed.state_dict(),
            "accordion": {
                "norms": dict(self._norms),
                "critical": dict(self._critical),
                "lrs": None if self._lrs is None else list(self._lrs),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or an older Accordion's (its single
        learning rate stands for every rank's; a decay it had seen makes every layer
        critical)."""
        self.window_step = int(state["window_step"])
        self.window_index = int(state["window_index"])
        self.smoothed.load_state_dict(state)
        saved = state["accordion"]
        self._norms = {int(k): float(v) for k, v in saved["norms"].items()}
        self._critical = {int(k): bool(v) for k, v in saved["critical"].items()}
        if "lrs" in saved:
            lrs = saved["lrs"]
            self._lrs = None if lrs is None else tuple(float(v) for v in lrs)
        else:
            lr = saved.get("lr")
            self._lrs = None if lr is None else (float(lr),)
            if saved.get("decayed") or saved.get("agreed_decay"):
                self._critical = dict.fromkeys(self._critical, True)
