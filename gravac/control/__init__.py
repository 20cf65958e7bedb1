"""Everything that chooses a CF: the protocol, the searches, the measures they read, the ladders.

* :mod:`gravac.control.protocol`: :class:`Controller`, what every search offers the engine
  (``plan()`` and ``observe(observation)``), and :mod:`gravac.control.records`, the records
  they pass (:class:`Plan`, :class:`Decision`, :class:`Observation`, :class:`Skipped`,
  :class:`Report`);
* :mod:`gravac.control.options`: :class:`ControllerConfig`, the hyperparameters and which
  search runs a ladder;
* :mod:`gravac.control.searches`: static, GraVAC's Algorithm 1, by trial, by shadow, Accordion;
* the measures: :mod:`gravac.control.tables` (smoothed gain and throughput),
  :mod:`gravac.control.window` (window gain), :mod:`gravac.control.replay` (error feedback
  replayed on a sample), :mod:`gravac.control.noise` (signal share), :mod:`gravac.control.link`
  (link model), :mod:`gravac.control.norms` (Accordion's interval sums);
* :mod:`gravac.control.policies`: the ladders (exponential, geometric), the static CF and
  Accordion's settings, with their registry;
* :mod:`gravac.control.factory`: :func:`make_controller`, the one place a search is chosen.
"""

from gravac.control import policies
from gravac.control.factory import make_controller
from gravac.control.options import ControllerConfig
from gravac.control.protocol import Controller
from gravac.control.records import Decision, Observation, Phase, Plan, Report, Skipped

__all__ = [
    "Controller",
    "ControllerConfig",
    "Decision",
    "Observation",
    "Phase",
    "Plan",
    "Report",
    "Skipped",
    "make_controller",
    "policies",
]
