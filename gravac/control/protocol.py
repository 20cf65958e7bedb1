"""The controller protocol: what every search offers the engine.

A controller plans a step from what it has observed, and observes each step once its values
are agreed over ranks (:mod:`gravac.control.records` has the records and the call order)::

    plan = controller.plan()
    report = controller.observe(Observation(plan, ...))     # or Skipped(plan)

Both are deterministic: every input is agreed over ranks, so every rank plans alike. The
searches (:mod:`gravac.control.searches`) implement it without inheriting from each other;
:func:`gravac.control.factory.make_controller` chooses one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from gravac.control.records import Observation, Plan, Report, Skipped

__all__ = ["Controller", "GradientUnits", "LayerKeyed"]


class Controller(Protocol):
    """What the engine asks of a search."""

    @property
    def phase(self) -> str:
        """Where the search is, as logged (``"warmup"``, ``"search"``, ``"settled"``,
        ``"fixed"``, ``"accordion"``)."""
        ...

    def plan(self) -> Plan:
        """What to compress, send and measure at the next step."""
        ...

    def observe(self, seen: Observation | Skipped) -> Report:
        """A step's agreed values (or that it was skipped on every rank): fold them and apply
        the search's rules; returns what the step is logged with, as the search saw it before
        its rules ran."""
        ...

    def resnap(self) -> None:
        """The compressor's deliverable CFs changed (a new layout): snap every CF held."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (plain Python values and tensors)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


@runtime_checkable
class LayerKeyed(Protocol):
    """A controller that keeps state by layer id (Accordion's regimes): the engine moves it when
    the front end's layout changes the ids."""

    def relayer(self, layers: Mapping[int, int]) -> None:
        """Move the state of each layer to its new id (``layers``: old id -> new id); drop that
        of layers not in ``layers``."""
        ...


@runtime_checkable
class GradientUnits(Protocol):
    """A controller that keeps values in the gradients' unit (Accordion's last interval
    norms): the engine scales them when that unit changes between steps (a loss scale)."""

    def rescale(self, factor: float) -> None:
        """Multiply every value kept in the gradients' unit by ``factor`` (> 0)."""
        ...
