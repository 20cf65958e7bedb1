"""The one place a search is chosen: a ladder and the controller's config to the search that
runs them (:class:`gravac.control.protocol.Controller`).

* a ladder with a static CF (``fixed``): :class:`gravac.control.searches.static.StaticController`;
* Accordion's settings (:class:`gravac.control.policies.AccordionPolicy`):
  :class:`gravac.control.searches.accordion.AccordionController`;
* an adaptive ladder (exponential, geometric), by the config's ``search``:
  ``"paper"``: GraVAC's Algorithm 1 (:class:`gravac.control.searches.paper.PaperController`);
  ``"trial"``: :class:`gravac.control.searches.trial.TrialController`;
  ``"shadow"``: :class:`gravac.control.searches.shadow.ShadowController`;
  ``"auto"``: the search by shadow where the compressor's sends can be replayed on a sample
  under plain error feedback (``replayable``), the search by trial otherwise.

Options that only the search by shadow runs (``search="shadow"``, ``horizon > 1``,
``noise=True``) are refused here, with the compressor that cannot run them named, when the
sends are not replayable or the ladder runs another search.
"""

from __future__ import annotations

from collections.abc import Callable

from gravac.control.options import ControllerConfig
from gravac.control.policies.accordion import AccordionPolicy
from gravac.control.policies.base import ScalingPolicy
from gravac.control.protocol import Controller
from gravac.control.searches.accordion import AccordionController
from gravac.control.searches.common import Setting
from gravac.control.searches.paper import PaperController
from gravac.control.searches.shadow import ShadowController
from gravac.control.searches.static import StaticController
from gravac.control.searches.trial import TrialController
from gravac.control.tables import snapper

__all__ = ["make_controller"]

#: the compressors whose sends the search by shadow can replay, for the messages below
_REPLAYABLE = "topk, redsync"


_Search = Callable[[Setting], Controller]


def _kind(policy: ScalingPolicy, config: ControllerConfig, replayable: bool) -> _Search:
    if isinstance(policy, AccordionPolicy):
        return AccordionController
    if policy.static_cf is not None:
        return StaticController
    if config.search == "paper":
        return PaperController
    shadow = config.search == "shadow" or (config.search == "auto" and replayable)
    return ShadowController if shadow else TrialController


def make_controller(
    policy: ScalingPolicy,
    config: ControllerConfig,
    world_size: int,
    snap: Callable[[float], float] | None = None,
    *,
    replayable: bool = False,
    ranked: bool = False,
    sender: str = "this compressor",
) -> Controller:
    """The controller that runs ``policy`` under ``config`` for ``world_size`` workers.

    Args:
        snap: the compressor's nearest deliverable CF to a requested one (``None``: every CF).
        replayable: the compressor's sends can be replayed on a sample under plain error
            feedback (:class:`gravac.compressors.base.Replayable` and a
            :class:`gravac.memory.ResidualMemory`).
        ranked: the compressor sends a tensor at a rank given per layer
            (:attr:`gravac.compressors.Compressor.takes_ranks`).
        sender: the compressor and its memory, as the messages name them.

    Raises:
        ValueError: the config asks for the search by shadow, or for an option only it takes,
            and the sends are not ``replayable`` or the ladder runs another search; Accordion's
            ranks are given for a compressor that sends at none.
    """
    if isinstance(policy, AccordionPolicy) and policy.ranks_given and not ranked:
        raise ValueError(
            f"accordion policy options low_rank and high_rank need a compressor that sends at "
            f"ranks (powersgd), got {sender}; give low_cf and high_cf instead"
        )
    kind = _kind(policy, config, replayable)
    if kind is ShadowController and not replayable:
        raise ValueError(
            f"search='shadow' needs a compressor whose sends can be replayed on a sample under "
            f"plain error feedback ({_REPLAYABLE}), got {sender}; use search='trial'"
        )
    shadow_only = [f"horizon={config.horizon}"] if (config.horizon or 1) > 1 else []
    shadow_only += ["noise=True"] if config.noise else []
    if shadow_only and kind is not ShadowController:
        raise ValueError(
            f"{' and '.join(shadow_only)} needs the search by shadow, which {sender} with "
            f"policy {policy.name!r} cannot run (an adaptive ladder and a compressor whose "
            f"sends can be replayed under plain error feedback: {_REPLAYABLE}); leave horizon "
            "at 1 and noise unset"
        )
    return kind(Setting(config, policy, world_size, snapper(snap), ranked))
