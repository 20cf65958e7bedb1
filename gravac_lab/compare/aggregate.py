"""Over seeds: each mode and variant's figures as the median and the min-max spread of its runs.

A study (:mod:`gravac_lab.compare.study`) runs every mode and gravac variant once per seed;
:func:`aggregate` groups the runs' :class:`gravac_lab.compare.report.ModeSummary` by mode and
variant (in the order they first ran) and reduces each figure of :data:`AGGREGATED` over the
seeds to a :class:`Spread`: the median, the lowest and the highest value.

Time and steps to target are censored: a run that never reached the target would have reached
it, if ever, after it ended. Such a run (``None``) sorts after every run that reached it, so:

* the median is ``None`` ("not reached") when the middle run did not reach it (for an even
  number of runs, when either middle run did not; otherwise their mean, as
  :func:`statistics.median`);
* the lowest is ``None`` only when no run reached it, and the highest whenever one did not.

Every other figure is ``None`` when no run measured it (the compression time of a DDP mode)
and reduced over the runs that did.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from gravac_lab.compare.report import ModeSummary

__all__ = ["AGGREGATED", "CENSORED", "Aggregate", "Spread", "aggregate", "spread"]

#: the :class:`ModeSummary` figures reduced over seeds
AGGREGATED = (
    "step_seconds",
    "forward_backward_seconds",
    "compute_seconds",
    "compress_seconds",
    "comm_seconds",
    "other_seconds",
    "wire_bytes",
    "wire_bytes_per_step",
    "internode_bytes_per_step",
    "final_metric",
    "time_to_target_seconds",
    "steps_to_target",
)
#: those of them where ``None`` means "not reached within the run", not "not measured"
CENSORED = ("time_to_target_seconds", "steps_to_target")


@dataclass(frozen=True)
class Spread:
    """A figure over seeds: its median and its range (``None``: see the module docstring)."""

    median: float | None
    min: float | None
    max: float | None


def _censored_median(ordered: list[float | None]) -> float | None:
    """The median of values sorted with ``None`` (beyond the run) last."""
    n = len(ordered)
    middle = ordered[(n - 1) // 2 : n // 2 + 1]  # one value, or the two middle ones
    if any(v is None for v in middle):
        return None
    return statistics.median(v for v in middle if v is not None)


def spread(values: Sequence[float | None], *, censored: bool = False) -> Spread:
    """The median, lowest and highest of ``values`` (one per seed); ``censored``: ``None`` is a
    target not reached, else a figure not measured (see the module docstring)."""
    known = sorted(v for v in values if v is not None)
    if not censored:
        if not known:
            return Spread(None, None, None)
        return Spread(statistics.median(known), known[0], known[-1])
    if not values:
        return Spread(None, None, None)
    ordered: list[float | None] = [*known, *(None for v in values if v is None)]
    return Spread(_censored_median(ordered), ordered[0], ordered[-1])


@dataclass(frozen=True)
class Aggregate:
    """One mode and variant over its seeds.

    Attributes:
        mode, variant: as in :class:`ModeSummary` (``variant`` ``None`` for a mode without).
        seeds: the seeds run, in the order they ran.
        reached: how many of them reached the target.
        comm_source: how the mode's communication time is known (:class:`ModeSummary`).
        dense_wire_bytes_per_step: what a float32 all-reduce of every parameter sends a step.
        ranks_agree: ``False`` if in any run a rank sent at another CF than rank 0,
            ``None`` for a mode that decides no CF.
        figures: each figure of :data:`AGGREGATED`, by name.
    """

    mode: str
    variant: str | None
    seeds: list[int]
    reached: int
    comm_source: str
    dense_wire_bytes_per_step: int
    ranks_agree: bool | None
    figures: dict[str, Spread]


def _agree(runs: Sequence[ModeSummary]) -> bool | None:
    known = [r.ranks_agree for r in runs if r.ranks_agree is not None]
    return all(known) if known else None


def aggregate(runs: Sequence[ModeSummary]) -> list[Aggregate]:
    """``runs`` grouped by mode and variant, in the order each group first appears, each
    group's figures reduced over its seeds."""
    groups: dict[tuple[str, str | None], list[ModeSummary]] = {}
    for run in runs:
        groups.setdefault((run.mode, run.variant), []).append(run)
    return [
        Aggregate(
            mode=mode,
            variant=variant,
            seeds=[r.seed for r in group],
            reached=sum(r.time_to_target_seconds is not None for r in group),
            comm_source=group[0].comm_source,
            dense_wire_bytes_per_step=group[0].dense_wire_bytes_per_step,
            ranks_agree=_agree(group),
            figures={
                name: spread([getattr(r, name) for r in group], censored=name in CENSORED)
                for name in AGGREGATED
            },
        )
        for (mode, variant), group in groups.items()
    ]
