"""Accordion's controller: per-layer regimes from gradient norms (docs/design.md section 9.6).

Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
Identification", MLSys 2021; the policy and its options are
:class:`gravac.control.policies.AccordionPolicy`. Per *layer* (each compressed tensor, keyed by the
front end's stable id, taken in launch order, identical on every rank)::

    every step:   acc[layer] += g[layer]            (the uncompressed local gradient)
    at the last step of each interval:
                  n[layer] = mean over ranks of ||acc[layer]||     (agreed with the step's scalars)
                  critical[layer] = no previous n, or |prev - n| / prev >= eta
                  prev = n; acc = 0
    each step sends every critical layer at low_cf, every other one at high_cf.

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

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gravac.control.controller import Controller, ControllerConfig, Decision, Phase, Plan
from gravac.control.policies.accordion import AccordionPolicy

__all__ = ["LR_DECAY_FRACTION", "AccordionController", "is_critical"]

#: a learning rate below this fraction of the previous step's is a decay: the drop of a step
#: schedule (usually 10x); a cosine or linear schedule moves far less in one step
LR_DECAY_FRACTION = 0.9


def is_critical(previous: float, new: float, eta: float) -> bool:
    """Accordion's rule: ``|previous - new| / previous >= eta``; a zero ``previous`` norm is
    critical (Accordion's code gives it ratio 9)."""
    return previous <= 0.0 or abs(previous - new) / previous >= eta


class AccordionController(Controller):
    """Runs :class:`gravac.control.policies.AccordionPolicy` behind the controller's call protocol
    (see the module docstrings of :mod:`gravac.control.controller` and of this module). Layers are
    keyed by the front end's stable ids (:attr:`gravac.engine.Unit.layers`), so that a
    checkpoint resumes them whatever the units' keys."""

    policy: AccordionPolicy
    tracks_gradients = True

    def __init__(
        self,
        config: ControllerConfig,
        policy: AccordionPolicy,
        world_size: int,
        snap: Callable[[float], float] | None = None,
    ) -> None:
        super().__init__(config, policy, world_size, snap)
        self.phase = Phase.ACCORDION
        self.low = self.snap(policy.low_cf)  # sent by critical layers
        self.high = self.snap(policy.high_cf)  # sent by the others
        self._acc: dict[int, Tensor] = {}  # layer -> its gradients summed over the interval
        self._tracked: dict[int, None] = {}  # layers tracked this interval, in launch order
        self._norms: dict[int, float] = {}  # layer -> the last interval's agreed norm
        self._critical: dict[int, bool] = {}  # layer -> its regime this interval
        self._lr: float | None = None  # the learning rate at the previous step
        self._decayed = False  # this rank saw a decay not yet agreed
        self._agreed_decay = False  # some rank saw one: every layer critical after this step
        self._agreed_norms: dict[int, float] | None = None  # at an interval's last step

    @property
    def _interval_ends(self) -> bool:
        return self.window_step == self.policy.interval - 1

    def resnap(self) -> None:
        super().resnap()
        self.low = self.snap(self.policy.low_cf)
        self.high = self.snap(self.policy.high_cf)

    def regimes(self) -> dict[int, bool]:
        """Each layer's regime this interval (``True``: critical, sent at ``low``); layers
        without a decision yet are sent at ``low``."""
        return dict(self._critical)

    # ----------------------------------------------------------------- per step
    def note_lr(self, lr: float | None) -> None:
        if lr is None:
            return
        if self._lr is not None and lr < LR_DECAY_FRACTION * self._lr:
            self._decayed = True
        self._lr = lr

    def plan(self) -> Plan:
        layers = {k: self.low if c else self.high for k, c in self._critical.items()}
        return Plan(self.low, None, measure=False, layer_cfs=layers, per_layer=True)

    def decide(self, plan: Plan) -> Decision:
        return Decision(cf=plan.theta_min, which="min")

    def track(self, layers: tuple[int, ...], grad: Tensor, numels: tuple[int, ...]) -> None:
        parts = grad.detach().reshape(-1).split(list(numels))
        for layer, part in zip(layers, parts, strict=True):
            acc = self._acc.get(layer)
            if acc is None or acc.numel() != part.numel():
                dtype = torch.promote_types(part.dtype, torch.float32)
                self._acc[layer] = part.to(dtype, copy=True)
            elif layer in self._tracked:
                acc.add_(part)
            else:  # the interval's first gradient: the buffer is reused
                acc.copy_(part)
            self._tracked[layer] = None

    def local_values(self) -> list[float]:
        """``[decay seen]``, and at an interval's last step each tracked layer's ``||acc||``."""
        values = [float(self._decayed)]
        if self._interval_ends:
            values += [float(torch.linalg.vector_norm(self._acc[k])) for k in self._tracked]
        return values

    def observe_values(self, table: Tensor) -> None:
        self._decayed = False  # agreed now
        self._agreed_decay = self._agreed_decay or bool(table[:, 0].max() > 0)
        if self._interval_ends:
            means = table[:, 1:].to(torch.float64).mean(dim=0).tolist()
            self._agreed_norms = dict(zip(self._tracked, means, strict=True))

    def end_step(self) -> None:
        self.window_step += 1
        if self.window_step >= self.policy.interval:
            self.window_step = 0
            self.window_index += 1
            self._new_regimes(self._agreed_norms or {})
        if self._agreed_decay:
            self._critical = dict.fromkeys(self._critical, True)
            self._agreed_decay = False

    def discard_step(self) -> None:
        self._tracked = {}
        self.window_step = 0

    def _new_regimes(self, norms: dict[int, float]) -> None:
        """The rule at an interval's end, for the layers tracked in it (others are dropped)."""
        eta = self.policy.eta
        self._critical = {
            k: k not in self._norms or is_critical(self._norms[k], n, eta) for k, n in norms.items()
        }
        self._norms = norms
        self._acc = {k: v for k, v in self._acc.items() if k in norms}
        self._agreed_norms = None
        self._tracked = {}

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "accordion": {
                "acc": {k: v.clone() for k, v in self._acc.items()},
                "tracked": list(self._tracked),
                "norms": dict(self._norms),
                "critical": dict(self._critical),
                "lr": self._lr,
                "decayed": self._decayed,
                "agreed_decay": self._agreed_decay,
                "agreed_norms": self._agreed_norms,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["accordion"]
        self._acc = {int(k): v.clone() for k, v in saved["acc"].items()}
        self._tracked = dict.fromkeys(int(k) for k in saved["tracked"])
        self._norms = {int(k): float(v) for k, v in saved["norms"].items()}
        self._critical = {int(k): bool(v) for k, v in saved["critical"].items()}
        self._lr = saved["lr"]
        self._decayed = bool(saved["decayed"])
        self._agreed_decay = bool(saved["agreed_decay"])
        agreed = saved["agreed_norms"]
        self._agreed_norms = None
        if agreed is not None:
            self._agreed_norms = {int(k): float(v) for k, v in agreed.items()}
