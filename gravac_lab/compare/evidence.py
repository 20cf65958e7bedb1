"""Which compression gain predicts time to accuracy: the evidence from static-CF runs.

The controller ranks CFs by compression throughput, system throughput times gain (GraVAC,
section III). That ranks them by time to accuracy exactly when the gain is the fraction of a
dense step's progress a compressed step makes: the steps dense needs to reach the target over
the steps the CF needs. From ``gravac compare`` studies that ran static CFs with
``measure=True`` (``topk:fixed{"cf": 100, "measure": true}``) beside dense DDP, on the same
workload and seed, :func:`evidence` sets each static run's measured gains beside that progress:

* ``gain_step``: the median per-step gain, the squared cosine of what a step sent and its
  error-fed gradient (Algorithm 1's; :mod:`gravac.gain`);
* ``gain_window``: the median window gain, the same for the sums of what a window of steps
  sent and of everything it had to send (:mod:`gravac.control.window`, the trial search's);
* ``cosine_window``: its square root, the cosine itself (for one step of a sparsifier
  ``||C(x)|| / ||x||``, the ratio of norms the GraVAC reference code's gain is);
* ``progress``: ``steps_to_target(dense) / steps_to_target(cf)`` (1: as fast per step as
  dense; the evaluations' spacing bounds its resolution).

A gain that predicts time to accuracy lies on the diagonal ``gain = progress``;
:func:`write_evidence_plot` draws the three against it, and :func:`distances` gives each one's
mean distance from it.

The search by shadow (:mod:`gravac.control.searches.shadow`) judges CFs it does not send by error
feedback replayed on a sample; the CF it sends is replayed too, so every window of such a run
measures its real window gain beside its shadow one, over the same steps: :func:`shadow_checks` and
:func:`shadow_markdown` set them side by side.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gravac_lab.compare.ratios import static_labels

__all__ = [
    "EvidenceRow",
    "ShadowCheck",
    "distances",
    "evidence",
    "markdown",
    "shadow_checks",
    "shadow_markdown",
    "write_evidence_plot",
]

#: the modes whose runs are the dense reference
_DENSE_MODES = ("ddp",)
#: inches of the evidence figure (three panels side by side)
_FIGSIZE = (14.0, 4.5)
#: the gains compared with the progress: field of :class:`EvidenceRow`, name, plot title
_GAINS = (
    ("gain_step", "per-step gain", "per-step gain (Algorithm 1)"),
    ("gain_window", "window gain", "window gain (squared cosine)"),
    ("cosine_window", "window cosine", "window cosine (its square root)"),
)
#: :func:`distances` leaves out the CFs up to this one: Top-k at CF 10 keeps a window gain of
#: 0.96-1.0 on every workload, where the progress of a run (0.56-1.5 at CF 10 on the ResNet)
#: is the noise of one evaluation's crossing of the target
_DISTANCE_MIN_CF = 10.0


@dataclass(frozen=True)
class EvidenceRow:
    """One static-CF run beside its dense reference (see the module docstring)."""

    workload: str
    label: str
    seed: int
    cf: float
    steps_to_target: int | None
    dense_steps_to_target: int | None
    gain_step: float | None
    gain_window: float | None

    @property
    def cosine_window(self) -> float | None:
        """The square root of :attr:`gain_window`: the cosine of the window's sums."""
        return None if self.gain_window is None else math.sqrt(self.gain_window)

    @property
    def progress(self) -> float | None:
        """Dense's steps to the target over this run's; 0 if this run never reached it."""
        if self.dense_steps_to_target is None:
            return None
        if self.steps_to_target is None:
            return 0.0
        return self.dense_steps_to_target / self.steps_to_target


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def evidence(summaries: Sequence[dict[str, Any]]) -> list[EvidenceRow]:
    """A row for every gravac run of a ``fixed`` policy variant in ``summaries`` (``gravac
    compare`` JSON outputs), beside the dense run of its workload and seed."""
    rows = []
    for summary in summaries:
        workload = summary["config"]["workload"]
        static = static_labels(summary)
        dense = {
            r["seed"]: r["steps_to_target"] for r in summary["runs"] if r["mode"] in _DENSE_MODES
        }
        for run in summary["runs"]:
            sent = {cf for cf in run.get("cf_sent_by_step", []) if cf is not None}
            if run["variant"] not in static or len(sent) != 1:
                continue
            rows.append(
                EvidenceRow(
                    workload=workload,
                    label=run["variant"],
                    seed=run["seed"],
                    cf=sent.pop(),
                    steps_to_target=run["steps_to_target"],
                    dense_steps_to_target=dense.get(run["seed"]),
                    gain_step=_median(run.get("gain_step_by_step", [])),
                    gain_window=_median(run.get("gain_window_by_step", [])),
                )
            )
    return rows


@dataclass(frozen=True)
class ShadowCheck:
    """One window of a run of the search by shadow: the real window gain of the CF it sent and
    that CF's shadow window gain, over the same steps."""

    workload: str
    link: str  # the study's --bandwidth, or "loopback"
    label: str
    seed: int
    step: int  # the step that carried the window's gains (1-based)
    cf: float
    real: float
    shadow: float


def shadow_checks(summaries: Sequence[dict[str, Any]]) -> list[ShadowCheck]:
    """Every window, in every run of ``summaries`` that logged shadow gains, whose CF sent has
    both gains (a dense window has no shadow of its own)."""
    out = []
    for summary in summaries:
        workload = summary["config"]["workload"]
        link = summary["config"].get("bandwidth") or "loopback"
        for run in summary["runs"]:
            shadows = run.get("gain_shadow_by_step") or []
            reals = run.get("gain_window_by_step") or []
            sent = run.get("cf_sent_by_step") or []
            for i, (gains, real, cf) in enumerate(zip(shadows, reals, sent, strict=False)):
                key = None if cf is None else f"{cf:g}"
                if gains and real is not None and key in gains:
                    where = (workload, link, run["variant"], run["seed"], i + 1)
                    out.append(ShadowCheck(*where, cf, real, gains[key]))
    return out


def shadow_markdown(checks: Sequence[ShadowCheck]) -> str:
    """Per run: its windows, the median real and shadow window gains of the CF sent, and the
    median and largest difference (shadow less real)."""
    lines = [
        "| workload | link | variant | seed | windows | real (median) | shadow (median) | "
        "shadow - real: median | largest |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    runs: dict[tuple[str, str, str, int], list[ShadowCheck]] = {}
    for c in checks:
        runs.setdefault((c.workload, c.link, c.label, c.seed), []).append(c)
    for (workload, link, label, seed), cs in runs.items():
        diffs = [c.shadow - c.real for c in cs]
        lines.append(
            f"| {workload} | {link} | {label} | {seed} | {len(cs)} | "
            f"{_cell(statistics.median(c.real for c in cs))} | "
            f"{_cell(statistics.median(c.shadow for c in cs))} | "
            f"{statistics.median(diffs):+.3f} | {max(diffs, key=abs):+.3f} |"
        )
    return "\n".join(lines) + "\n"


def _cell(value: float | int | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def markdown(rows: Sequence[EvidenceRow]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| workload | variant | seed | CF | steps to target | dense's | progress | "
        "per-step gain | window gain | window cosine |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.workload} | {r.label} | {r.seed} | {r.cf:g} | {_cell(r.steps_to_target)} | "
            f"{_cell(r.dense_steps_to_target)} | {_cell(r.progress, 2)} | "
            f"{_cell(r.gain_step)} | {_cell(r.gain_window)} | {_cell(r.cosine_window)} |"
        )
    far = distances(rows)
    lines.append("")
    lines.append(
        f"Mean |gain - progress| over the runs above CF {_DISTANCE_MIN_CF:g}: "
        + ", ".join(f"{name} {_cell(far[field])}" for field, name, _ in _GAINS)
    )
    return "\n".join(lines) + "\n"


def distances(rows: Sequence[EvidenceRow]) -> dict[str, float | None]:
    """Each gain's mean absolute distance from the progress, by field name, over the rows above
    :data:`_DISTANCE_MIN_CF` that have both (``None``: no such row)."""
    out: dict[str, float | None] = {}
    for field, _, _ in _GAINS:
        gaps = [
            abs(g - r.progress)
            for r in rows
            if r.cf > _DISTANCE_MIN_CF
            and (g := getattr(r, field)) is not None
            and r.progress is not None
        ]
        out[field] = statistics.mean(gaps) if gaps else None
    return out


def write_evidence_plot(rows: Sequence[EvidenceRow], path: Path) -> Path:
    """Each gain of every row against its progress, one marker a workload, the diagonal
    where a gain predicts time to accuracy; written as a PNG to ``path``."""
    from matplotlib.figure import Figure  # the demo and dev extras

    fig = Figure(figsize=_FIGSIZE)
    axes = fig.subplots(1, len(_GAINS), sharey=True)
    markers = dict(zip(sorted({r.workload for r in rows}), "os^Dv<>", strict=False))
    for ax, (field, _, title) in zip(axes, _GAINS, strict=True):
        for workload, marker in markers.items():
            points = [
                (getattr(r, field), r.progress)
                for r in rows
                if r.workload == workload
                and getattr(r, field) is not None
                and r.progress is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.scatter(xs, ys, marker=marker, label=workload)
            for r in rows:
                g = getattr(r, field)
                if r.workload == workload and g is not None and r.progress is not None:
                    ax.annotate(f"{r.cf:g}", (g, r.progress), fontsize=7)
        ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, 1.05)
        ax.set_ylim(0, 1.25)
        ax.set_title(title)
        ax.set_xlabel("gain (median over the run)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("progress per step against dense (steps to target)")
    axes[-1].legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
