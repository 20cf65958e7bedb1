"""Everything that chooses a CF: the searches, the measures they read, the ladders.

* :mod:`gravac.control.controller`: the records a controller plans and decides with
  (:class:`ControllerConfig`, :class:`Plan`, :class:`Decision`, :class:`Phase`) and GraVAC's
  Algorithm 1, the base the other searches share;
* the searches: :mod:`gravac.control.trial` (by trial), :mod:`gravac.control.shadow_search`
  (by shadow), :mod:`gravac.control.accordion` (Accordion);
* the measures: :mod:`gravac.control.window` (window gain), :mod:`gravac.control.replay`
  (error feedback replayed on a sample), :mod:`gravac.control.noise` (signal share);
* :mod:`gravac.control.policies`: the ladders (exponential, geometric), the static CF and
  Accordion's settings, with their registry;
* :mod:`gravac.control.factory`: :func:`make_controller`, the one place a search is chosen.
"""

from gravac.control import policies
from gravac.control.controller import Controller, ControllerConfig, Decision, Phase, Plan
from gravac.control.factory import make_controller

__all__ = [
    "Controller",
    "ControllerConfig",
    "Decision",
    "Phase",
    "Plan",
    "make_controller",
    "policies",
]
