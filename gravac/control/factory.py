"""The one place a search is chosen: a policy and its options to the controller that runs it.

* a policy with a static CF (``fixed``): :class:`gravac.control.controller.Controller`, which
  sends that CF at every step;
* Accordion (:class:`gravac.control.policies.AccordionPolicy`):
  :class:`gravac.control.accordion.AccordionController`;
* an adaptive ladder (exponential, geometric), by its ``search`` option:
  ``"paper"``: GraVAC's Algorithm 1 (:class:`gravac.control.controller.Controller`);
  ``"trial"``: :class:`gravac.control.trial.TrialController`;
  ``"shadow"``: :class:`gravac.control.shadow_search.ShadowController`;
  ``"auto"``: the search by shadow where the compressor's sends can be replayed on a sample
  under plain error feedback (``replayable``), the search by trial otherwise.

Options that only the search by shadow runs (``search="shadow"``, ``horizon > 1``,
``noise=True``) are refused here, with the compressor that cannot run them named, when the
sends are not replayable.
"""

from __future__ import annotations

from collections.abc import Callable

from gravac.control.accordion import AccordionController
from gravac.control.controller import Controller, ControllerConfig
from gravac.control.policies.accordion import AccordionPolicy
from gravac.control.policies.base import ScalingPolicy
from gravac.control.shadow_search import ShadowController
from gravac.control.trial import TrialController

__all__ = ["make_controller"]

#: the compressors whose sends the search by shadow can replay, for the messages below
_REPLAYABLE = "topk, redsync"


def make_controller(
    policy: ScalingPolicy,
    config: ControllerConfig,
    world_size: int,
    snap: Callable[[float], float] | None = None,
    *,
    replayable: bool = False,
    sender: str = "this compressor",
) -> Controller:
    """The controller that runs ``policy`` under ``config`` for ``world_size`` workers.

    Args:
        snap: the compressor's nearest deliverable CF to a requested one (``None``: every CF).
        replayable: the compressor's sends can be replayed on a sample under plain error
            feedback (:class:`gravac.compressors.base.Replayable` and a
            :class:`gravac.memory.ResidualMemory`).
        sender: the compressor and its memory, as the messages name them.

    Raises:
        ValueError: the policy asks for the search by shadow, or for an option only it takes,
            and the sends are not ``replayable``.
    """
    kind: type[Controller] = Controller
    if isinstance(policy, AccordionPolicy):
        kind = AccordionController
    elif policy.static_cf is None and policy.search != "paper":
        shadow = policy.search == "shadow" or (policy.search == "auto" and replayable)
        kind = ShadowController if shadow else TrialController
    if kind is ShadowController and not replayable:
        raise ValueError(
            f"policy option search='shadow' needs a compressor whose sends can be replayed "
            f"on a sample under plain error feedback ({_REPLAYABLE}), got {sender}; use "
            "search='trial'"
        )
    shadow_only = [f"horizon={policy.horizon}"] if (policy.horizon or 1) > 1 else []
    shadow_only += ["noise=True"] if policy.noise else []
    if shadow_only and kind is not ShadowController:
        raise ValueError(
            f"policy option {' and '.join(shadow_only)} needs the search by shadow, which "
            f"{sender} cannot run (a compressor whose sends can be replayed under plain error "
            f"feedback: {_REPLAYABLE}); leave horizon at 1 and noise unset"
        )
    return kind(config, policy, world_size, snap=snap)
