"""What a committed step shows the controller and the log (docs/design.md sections 8 and 11):
the agreed gains and times as an :class:`~gravac.control.records.Observation`, and the step as a
:class:`~gravac.monitor.StepRecord`.

Every value here comes from the step's table of every rank's scalars, so every rank shows its
controller the same observation and takes the same decision at the next step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gravac.control.records import DENSE, Decision, Observation, Plan, Report, Sample
from gravac.engine.records import Flight, Step
from gravac.engine.scalars import Table, Terms
from gravac.monitor import StepRecord

__all__ = ["Seen", "achieved_cf", "agreed_gains", "observation", "step_record"]


@dataclass
class Seen:
    """What a committed step's agreed values say (:meth:`Engine.commit`): the plan and the
    decision it ran (none when nothing was compressed), the compressed flights, the gains."""

    plan: Plan
    decision: Decision
    compressed: list[Flight]
    report: Report
    gain_min: float = math.nan
    gain_candidate: float | None = None
    gain_window: float = math.nan
    shadow_gains: dict[float, float] = dataclasses.field(default_factory=dict)
    share: float | None = None

    @property
    def search(self) -> bool:
        """Whether the step took part in the controller's search (something compressed)."""
        return bool(self.compressed)


def agreed_gains(step: Step, terms: Terms, phase: str, windowed: bool) -> Seen:
    """What ``step``'s gain ``terms``, summed over ranks, say (:mod:`gravac.gain`): the gain
    at ``theta_min`` and at the candidate where the plan measured them, the window's where
    it closed one (``windowed``: window gains are measured) and its shadows'; a step that
    compressed nothing ran no search (its plan dense, no gains). ``phase``: the controller's
    phase, until it reports after observing."""
    compressed = [f for f in step.flights if f.unit.compressed]
    plan, decision = step.plan, step.decision
    if not compressed:  # nothing to compress: no gains, no search
        plan, decision = Plan(plan.cf, DENSE, measure=False), DENSE
    seen = Seen(plan, decision, compressed, Report(phase))
    seen.gain_min = terms.gain_min if plan.measure else math.nan
    if plan.candidate is not None and plan.measure:
        seen.gain_candidate = terms.gain_candidate
    if plan.window_terms and plan.shadows:
        seen.shadow_gains = terms.shadow_gains(plan.shadows)
    if plan.window_terms and windowed:
        seen.gain_window = terms.gain_window
    return seen


def observation(
    seen: Seen,
    table: Table,
    *,
    last_cf: float | None,
    samples: int,
    norm_layers: Sequence[int],
) -> Observation:
    """What the controller is shown of a step that compressed something: every value agreed
    over ranks, the step before's time counted at the CF it sent (``last_cf``).

    System throughput is ``samples / interval`` (``samples``: every rank's batch, or one per
    rank when unknown; ``interval``: the step before's agreed seconds, from the end of the step
    before it to its own end, :meth:`gravac.engine.Engine.commit`); the exposed
    communication time is counted per sample. With a plan's ``norms`` (Accordion), every
    rank's learning rate and, at an interval's end, the mean over ranks of each layer's norm
    (``norm_layers``: the layers, in the order the ranks sent their norms).
    """
    plan = seen.plan
    interval, exposed = table.interval, table.exposed
    throughput = comm = None
    if interval > 0 and last_cf is not None:
        throughput = Sample(last_cf, samples / interval)
    if exposed >= 0 and last_cf is not None:
        comm = Sample(last_cf, exposed / samples)
    lrs: tuple[float, ...] = ()
    norms = None
    if plan.norms:
        values = table.controller_values.to(torch.float64)
        lrs = tuple(values[:, 0].tolist())
        if plan.norms_due:
            means = values[:, 1:].mean(dim=0).tolist()
            norms = dict(zip(norm_layers, means, strict=True))
    return Observation(
        plan,
        gain=seen.gain_min,
        gain_candidate=seen.gain_candidate,
        gain_window=seen.gain_window if plan.window_terms else None,
        shadow_gains=seen.shadow_gains,
        signal_share=seen.share,
        throughput=throughput,
        comm=comm,
        lrs=lrs,
        layer_norms=norms,
    )


def step_record(step: Step, seen: Seen, comm_seconds: float, skipped_steps: int) -> StepRecord:
    """What ``step`` did, for the log (``skipped_steps``: skipped so far)."""
    plan, compressed, report = seen.plan, seen.compressed, seen.report
    return StepRecord(
        step=step.index,
        phase=report.phase,
        cf_sent=achieved_cf(compressed) if plan.per_layer else seen.decision.cf,
        cf_achieved=achieved_cf(compressed),
        sent=seen.decision.which,
        theta_min=plan.cf,
        cf_candidate=plan.candidate,
        gain_min=report.gain,
        gain_candidate=report.gain_candidate,
        gain_min_step=seen.gain_min,
        gain_candidate_step=seen.gain_candidate,
        gain_window=seen.gain_window if plan.window_terms else None,
        gain_shadow=tuple(seen.shadow_gains.items()),
        signal=seen.share,
        judged=report.judged,
        system_throughput=report.system_throughput,
        compression_throughput=report.compression_throughput,
        wire_bytes=sum(f.wire_bytes for f in step.flights),
        dense_wire_bytes=4 * sum(f.unit.numel for f in step.flights),
        compress_seconds=step.compress_seconds,
        comm_seconds=comm_seconds,
        skipped_steps=skipped_steps,
    )


def achieved_cf(flights: Sequence[Flight]) -> float:
    """The CF achieved over the compressed units: ``sum numel / sum sent``, elements over the
    float32 elements' worth they sent (1 where they sent nothing)."""
    numel = sum(f.unit.numel for f in flights)
    sent = sum(f.sent_elements for f in flights)
    return numel / sent if sent > 0 else 1.0
