"""Each variant's time to target against the best static CF's, seed by seed.

The controller's target (issue 12) is a time to accuracy within 1.1x of the best static CF's,
without being told which CF that is. One seed says little: where the test metric hovers around
the target, the first evaluation that crosses it moves by tens of steps between seeds
(``docs/studies/2026-11-30-targets.md``). From ``gravac compare`` studies (their JSON) that ran
static CFs (``fixed`` policy variants) beside other variants on the same seeds, :func:`ratios` gives
every run's time to the target over that of the fastest static CF *of the same study and seed*,
and :func:`markdown` the median over seeds of each variant and study.

With ``hold`` above 1 a run's time to target is that of the first evaluation from which the
metric stays at the target for ``hold`` evaluations in a row (or to the run's end, if fewer
are left), read from the run's evaluations: a stricter clock, that one lucky evaluation does not
stop, for asking how much a ranking owes to where the metric happened to cross.

A study is a workload on a link (``--bandwidth``, or loopback). Files of the same study are
pooled: a seed's best static CF may come from another file than the variant (a later study that
ran only new variants on the seeds of an earlier one); both must then have run on the same
machine, which the caller knows and these files do not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gravac_lab.compare import workloads

__all__ = [
    "RatioRow",
    "held_seconds",
    "markdown",
    "ratios",
    "static_labels",
    "study_label",
    "totals_markdown",
]

#: bytes in a megabyte, as ``gravac compare`` reports them
_MB = 1e6

#: the target's tolerance: a variant is "within" when its median ratio is at most this
WITHIN = 1.1


@dataclass(frozen=True)
class RatioRow:
    """One run beside the fastest static CF of its study and seed (times in seconds)."""

    study: str
    variant: str
    seed: int
    seconds: float | None  # time to the target; None: not reached
    best: str  # the fastest static variant of the study and seed
    best_seconds: float
    wire_bytes: int
    final_metric: float

    @property
    def ratio(self) -> float:
        """``seconds / best_seconds``; ``inf`` if this run never reached the target."""
        return math.inf if self.seconds is None else self.seconds / self.best_seconds


def study_label(summary: dict[str, Any]) -> str:
    """``"WORKLOAD LINK"``: the workload and the ``--bandwidth`` (``loopback`` without)."""
    link = summary["config"].get("bandwidth") or "loopback"
    return f"{summary['config']['workload']} {link}"


def static_labels(summary: dict[str, Any]) -> set[str]:
    """The labels of a study's static variants (its ``fixed`` policy ones)."""
    variants = (summary.get("study") or {}).get("variants") or []
    return {v["label"] for v in variants if v["policy"] == "fixed"}


def held_seconds(run: dict[str, Any], workload: str, hold: int) -> float | None:
    """The training time of ``run``'s first evaluation from which the metric reaches the
    target at ``hold`` evaluations in a row (fewer where the run ends first); ``None`` if
    there is none. ``hold=1`` is the run's own time to target.

    Raises:
        ValueError: ``hold`` is not an integer >= 1, or ``run`` has no evaluations.
    """
    if not isinstance(hold, int) or isinstance(hold, bool) or hold < 1:
        raise ValueError(f"hold must be an integer >= 1, got {hold!r}")
    evaluations = run.get("evaluations")
    if not evaluations:
        raise ValueError(f"run {run.get('variant')!r} (seed {run.get('seed')}) has no evaluations")
    meets = workloads.get(workload).reached
    reached = [meets(m, run["target"]) for _, _, m in evaluations]
    for i, (_, seconds, _) in enumerate(evaluations):
        if all(reached[i : i + hold]):
            return float(seconds)
    return None


def ratios(summaries: Sequence[dict[str, Any]], hold: int = 1) -> list[RatioRow]:
    """A row for every gravac variant run in ``summaries`` whose study and seed have a static
    CF that reached the target (static runs included: the best one's ratio is 1); with
    ``hold`` above 1 every time to target is :func:`held_seconds`'s."""
    runs: list[tuple[str, bool, dict[str, Any], float | None]] = []
    for summary in summaries:
        static = static_labels(summary)
        label = study_label(summary)
        workload = summary["config"]["workload"]
        runs += [
            (
                label,
                r["variant"] in static,
                r,
                r["time_to_target_seconds"] if hold == 1 else held_seconds(r, workload, hold),
            )
            for r in summary["runs"]
            if r["variant"]
        ]
    best: dict[tuple[str, int], tuple[float, str]] = {}
    for study, is_static, r, t in runs:
        key = (study, r["seed"])
        if is_static and t is not None and (key not in best or t < best[key][0]):
            best[key] = (t, r["variant"])
    rows = []
    for study, _, r, t in runs:
        key = (study, r["seed"])
        if key not in best:
            continue
        rows.append(
            RatioRow(
                study=study,
                variant=r["variant"],
                seed=r["seed"],
                seconds=t,
                best=best[key][1],
                best_seconds=best[key][0],
                wire_bytes=r["wire_bytes"],
                final_metric=r["final_metric"],
            )
        )
    return rows


def _ratio_cell(values: Sequence[float]) -> str:
    def one(v: float) -> str:
        return "–" if math.isinf(v) else f"{v:.2f}"

    return f"{one(statistics.median(values))} ({' / '.join(one(v) for v in values)})"


def markdown(rows: Sequence[RatioRow]) -> str:
    """A table of variants (rows) by studies (columns): the median ratio over seeds, each
    seed's in brackets (``–``: not reached), and how many studies each variant is within
    :data:`WITHIN` of the best static CF in."""
    studies, grid = _grid(rows)
    lines = [
        "| variant | " + " | ".join(studies) + f" | within {WITHIN:g}x |",
        "|---|" + "--:|" * (len(studies) + 1),
    ]
    for v, cells in grid.items():
        medians = [statistics.median(r.ratio for r in mine) for mine in cells if mine]
        within = sum(m <= WITHIN for m in medians)
        texts = [_ratio_cell([r.ratio for r in mine]) if mine else "" for mine in cells]
        lines.append(f"| {v} | " + " | ".join(texts) + f" | {within} of {len(medians)} |")
    seeds = sorted({r.seed for r in rows})
    lines += [
        "",
        f"Time to target over the fastest static CF's of the same study and seed; median over "
        f"seeds {', '.join(map(str, seeds))} (each seed's in brackets, in seed order).",
    ]
    return "\n".join(lines) + "\n"


def totals_markdown(rows: Sequence[RatioRow]) -> str:
    """A table of variants by studies: the median over seeds of the megabytes a rank sent in
    the whole run, and of the final metric."""
    studies, grid = _grid(rows)
    lines = [
        "| variant | " + " | ".join(studies) + " |",
        "|---|" + "--:|" * len(studies),
    ]
    for v, cells in grid.items():
        texts = [_totals_cell(mine) if mine else "" for mine in cells]
        lines.append(f"| {v} | " + " | ".join(texts) + " |")
    lines += ["", "Median over seeds of the MB a rank sent in the run, and of the final metric."]
    return "\n".join(lines) + "\n"


def _totals_cell(rows: Sequence[RatioRow]) -> str:
    mb = statistics.median(r.wire_bytes for r in rows) / _MB
    return f"{mb:.0f} MB, {statistics.median(r.final_metric for r in rows):.3f}"


def _grid(rows: Sequence[RatioRow]) -> tuple[list[str], dict[str, list[list[RatioRow]]]]:
    """The studies, sorted, and for each variant (sorted) its rows in each study, by seed."""
    studies = sorted({r.study for r in rows})
    grid = {
        v: [sorted((r for r in rows if (r.variant, r.study) == (v, s)), key=_seed) for s in studies]
        for v in sorted({r.variant for r in rows})
    }
    return studies, grid


def _seed(row: RatioRow) -> int:
    return row.seed
