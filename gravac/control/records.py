"""What a controller plans, what it is shown, and what it reports: the records of its protocol.

One step, as the engine runs it (docs/design.md section 9)::

    plan = controller.plan()        # from values agreed through the step before
    ... compress at plan.cf (and plan.candidate), send what plan.send names, agree the
        step's scalars ...
    report = controller.observe(Observation(plan, ...))   # or observe(Skipped(plan))

A :class:`Plan` says what to compress and what to send, and which measures the step should
take; an :class:`Observation` carries what the step measured, every value agreed over ranks;
a :class:`Report` is what the step is logged with. Nothing else passes between the engine and
a controller, so a controller is a deterministic function of its observations: ranks that see
the same observations decide alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

__all__ = ["DENSE", "Decision", "Observation", "Phase", "Plan", "Report", "Sample", "Skipped"]


class Phase(str, Enum):
    """Where a search over a ladder is: warm-up, searching, or settled on theta_ideal."""

    WARMUP = "warmup"
    SEARCH = "search"
    SETTLED = "settled"


@dataclass(frozen=True)
class Decision:
    """What to send this step: ``cf`` (1.0 for dense) and which compression produced it."""

    cf: float
    which: Literal["candidate", "min", "dense"]


#: the dense fallback: every element sent, the residuals cleared
DENSE = Decision(cf=1.0, which="dense")


@dataclass(frozen=True)
class Plan:
    """What to compress and send at a step, and what to measure.

    Attributes:
        cf: the CF every compressed unit is compressed at (but the layers of ``layer_cfs``).
        send: the decision: ``cf``, ``candidate`` or dense.
        candidate: a second CF compressed at too, to measure its gain (Algorithm 1).
        measure: whether the step's per-step gains are wanted (a static CF's decisions never
            read them: the engine then skips their terms).
        layer_cfs: CFs by layer (a tensor's stable id, :attr:`gravac.engine.Unit.layer_ids`),
            sent instead of ``cf``; ``per_layer``: the plan decides per layer, so the CF sent is
            reported as the one achieved.
        rank: for a compressor that takes ranks (:attr:`gravac.compressors.Compressor.takes_ranks`),
            the rank every compressed tensor is sent at (but the layers of ``layer_ranks``), in
            place of its CF's; ``None``: the CFs decide.
        window_terms: the step carries the gain of the window that ended before it
            (:mod:`gravac.control.window`) and starts the next window.
        shadows: CFs whose window gains are measured without sending them
            (:mod:`gravac.control.replay`), at every step of every window.
        signal: the step that carries the window's gain also measures the signal share of the
            window's gradient over ranks (:mod:`gravac.control.noise`).
        horizon: windows a window gain spans (the sums of ``horizon - 1`` windows are kept
            when one closes).
        norms: the step adds each layer's gradient to the interval's sums
            (:mod:`gravac.control.norms`) and sends the rank's learning rate with its scalars;
            ``norms_due``: the step ends the interval and sends each layer's norm too.
    """

    cf: float
    send: Decision
    candidate: float | None = None
    measure: bool = True
    layer_cfs: Mapping[int, float] = field(default_factory=dict)
    per_layer: bool = False
    rank: int | None = None
    layer_ranks: Mapping[int, int] = field(default_factory=dict)
    window_terms: bool = False
    shadows: tuple[float, ...] = ()
    signal: bool = False
    horizon: int = 1
    norms: bool = False
    norms_due: bool = False

    def cfs_for(self, layers: tuple[int, ...]) -> tuple[float, ...]:
        """The CF of each of ``layers``."""
        return tuple(self.layer_cfs.get(k, self.cf) for k in layers)

    def ranks_for(self, layers: tuple[int, ...]) -> tuple[int, ...] | None:
        """The rank of each of ``layers``; ``None`` where the plan gives no ranks."""
        if self.rank is None:
            return None
        return tuple(self.layer_ranks.get(k, self.rank) for k in layers)


@dataclass(frozen=True)
class Sample:
    """A value measured while sending at ``cf``."""

    cf: float
    value: float


@dataclass(frozen=True)
class Observation:
    """What a step that was taken measured, every value agreed over ranks.

    Attributes:
        plan: the step's plan.
        gain: the per-step gain at ``plan.cf`` (NaN when the plan measures none).
        gain_candidate: the per-step gain at ``plan.candidate``, if it has one.
        gain_window: with ``plan.window_terms``, the gain of the window that ended before the
            step (NaN where it could not be measured); ``None`` otherwise.
        shadow_gains: with ``plan.window_terms``, the window gains of ``plan.shadows``.
        signal_share: with ``plan.signal``, the window's signal share (``None``: none).
        throughput: the step before's system throughput, samples per second, at the CF it
            sent (``None``: not timed).
        comm: the step before's exposed communication, seconds per sample, at the CF it sent.
        lrs: with ``plan.norms``, every rank's learning rate at the step (NaN: unknown).
        layer_norms: with ``plan.norms_due``, each layer's norm of its gradients summed over
            the interval, the mean over ranks, in launch order.
    """

    plan: Plan
    gain: float = math.nan
    gain_candidate: float | None = None
    gain_window: float | None = None
    shadow_gains: Mapping[float, float] = field(default_factory=dict)
    signal_share: float | None = None
    throughput: Sample | None = None
    comm: Sample | None = None
    lrs: tuple[float, ...] = ()
    layer_norms: Mapping[int, float] | None = None


@dataclass(frozen=True)
class Skipped:
    """A step skipped on every rank (a non-finite value): it measured nothing."""

    plan: Plan


@dataclass(frozen=True)
class Report:
    """What a step is logged with, as the controller saw it before applying its rules.

    Attributes:
        phase: the search's phase (:class:`Phase`, ``"fixed"`` or ``"accordion"``).
        gain: the smoothed gain at the plan's CF; ``gain_candidate``: at its candidate.
        system_throughput: samples per second at the CF sent; ``compression_throughput``:
            times its gain.
        judged: where the step closed a window and the search chose the next window's CF from
            a table (the search by shadow), what its rule compared, by CF ascending:
            ``(cf, judged gain, estimated samples per second)``, NaN where it had none.
    """

    phase: str
    gain: float | None = None
    gain_candidate: float | None = None
    system_throughput: float | None = None
    compression_throughput: float | None = None
    judged: tuple[tuple[float, float, float], ...] = ()
