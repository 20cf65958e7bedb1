"""The results page (``docs/RESULTS.md``) and its plots, from stored scoreboards.

``gravac compare --scoreboard --from-json A.json B.json ... --report PAGE`` (or ``--report``
after a scoreboard trains) writes :func:`write_page`: a summary table, the goals judged, and a
section a setup with its command, commit, scoreboard rows and figures. Each stored scoreboard
(``gravac compare --scoreboard --baselines --out``) may hold several setups at one worker count;
``scripts/results.sh`` trains the ones :data:`PAGE_SETUPS` names and rebuilds the page.

Every figure compares the same runs the table judges (:func:`gravac_lab.compare.scoreboard.
setup_runs`): dense DDP, DDP with the fp16 hook, the yardstick (the fastest static CF that
reaches the bar on every seed), the searches and Accordion, their clocks on the setup's link.
The figures are :mod:`gravac_lab.compare.plots`', drawn under :data:`PLOTS` beside the page,
one folder a setup. Why a goal is missed takes reading the runs: a file :data:`READING` beside
the figures, written by hand, follows the goals' table.

The goals (issue 35), each judged on the median over the seeds of the default search's ratio
to the baseline on the same seed (:func:`gravac_lab.compare.scoreboard.versus`), and only where
the default reached the bar on every seed:

* against Accordion as the GraVAC paper ran it, time to the bar at most ``1 /``
  :data:`SOONER_THAN_ACCORDION` of Accordion's on the communication-heavy workload
  (:data:`COMM_HEAVY`), and at most Accordion's on the others;
* at least :data:`FEWER_BYTES_THAN_ACCORDION` times fewer MB to the bar than Accordion;
* at most :data:`VERSUS_FP16` of DDP with PyTorch's fp16 hook's time where the link is the
  bottleneck: where DDP's communication not hidden behind backward is at least
  :data:`LINK_BOUND_SHARE` of its step on that link (its timing run on the first seed timed;
  on loopback its own on the first seed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gravac_lab.compare import plots
from gravac_lab.compare.scoreboard import (
    BASELINES,
    DENSE,
    FP16,
    SetupRuns,
    SetupScore,
    score,
    setup_runs,
    versus,
)
from gravac_lab.compare.scoreboard_table import (
    bar_text,
    mb_reaches,
    seconds_cell,
    setup_detail,
    versus_cells,
    yardstick_text,
)

__all__ = [
    "COMM_HEAVY",
    "FEWER_BYTES_THAN_ACCORDION",
    "LINK_BOUND_SHARE",
    "PAGE_SETUPS",
    "PLOTS",
    "READING",
    "SOONER_THAN_ACCORDION",
    "VERSUS_FP16",
    "Goal",
    "PageSetup",
    "goals",
    "link_bound",
    "page_setups",
    "write_page",
]

#: the setups the page shows (workload, link, workers): every workload at both links, and the
#: communication-heavy one at 4 workers too
PAGE_SETUPS = (
    *(
        (w, link, 2)
        for w in ("vgg-digits", "resnet-digits", "lstm-text")
        for link in ("1gbit", "100mbit")
    ),
    ("vgg-digits", "1gbit", 4),
    ("vgg-digits", "100mbit", 4),
)
#: the workload whose gradient is largest against its compute (21.3 MB a step of VGG)
COMM_HEAVY = "vgg-digits"
#: the default search reaches the bar at least this many times sooner than Accordion on
#: :data:`COMM_HEAVY` (the GraVAC paper measured 1.94-5.63x)
SOONER_THAN_ACCORDION = 1.5
#: the default sends at least this many times fewer MB to the bar than Accordion (the paper:
#: 44.5-104x)
FEWER_BYTES_THAN_ACCORDION = 10.0
#: the default's time to the bar at most this share of DDP with the fp16 hook's where the link
#: is the bottleneck
VERSUS_FP16 = 0.8
#: a link is the bottleneck where DDP's exposed communication is at least this share of its step
LINK_BOUND_SHARE = 0.5
#: where the figures go, relative to the page's folder
PLOTS = Path("results") / "page"
#: a hand-written reading of the goals (why one is missed), relative to the page's folder: the
#: page shows it after the goals' table where it exists
READING = PLOTS / "reading.md"
#: the search judged against the baselines, and the paper's Algorithm 1
_DEFAULT = "default"
_PAPER = "paper"
#: Accordion's row label
_ACCORDION = BASELINES[1]
#: the figures a section shows, with their captions
_FIGURES = (
    ("metric_time", "metric against training seconds"),
    ("metric_bytes", "metric against MB sent"),
    ("cf_steps", "CF sent at every step"),
    ("cf_density", "how the steps spread over the CFs sent"),
)


@dataclass(frozen=True)
class PageSetup:
    """One setup of a stored scoreboard.

    Attributes:
        score: its scoreboard.
        runs: its runs, clocks on its link.
        workers: workers it trained with.
        command: the command line that trained it (``None``: not stored).
        commit: the commit it ran (``None``: not stored or not a checkout).
    """

    score: SetupScore
    runs: SetupRuns
    workers: int
    command: str | None
    commit: str | None

    @property
    def name(self) -> str:
        """``WORKLOAD@LINK, N workers``."""
        return _setup_name(self.score.setup, self.workers)

    @property
    def slug(self) -> str:
        """``WORKLOAD-LINK-Nw``: its figures' folder."""
        return f"{self.score.setup.replace('@', '-')}-{self.workers}w"


def page_setups(stored: Sequence[Mapping[str, Any]]) -> list[PageSetup]:
    """Every finished setup of every stored scoreboard, in order.

    Raises:
        ValueError: a setup's studies are incomplete (see :func:`gravac_lab.compare.scoreboard.
            score`), or two scoreboards hold the same setup at the same worker count.
    """
    out: list[PageSetup] = []
    for board in stored:
        header = board["scoreboard"]
        for s in score(board):
            workload, _, link = s.setup.partition("@")
            runs = setup_runs(board["studies"], workload, None if link == "loopback" else link)
            page = PageSetup(
                s, runs, header["workers"], header.get("command"), header.get("commit")
            )
            if any(p.name == page.name for p in out):
                raise ValueError(f"two stored scoreboards hold {page.name}: give one")
            out.append(page)
    return out


def _setup_name(setup: str, workers: int) -> str:
    """A setup's name on the page: ``WORKLOAD@LINK, N workers``."""
    return f"{setup}, {workers} workers"


def _page_names() -> list[str]:
    """The names of :data:`PAGE_SETUPS`, in order."""
    return [_setup_name(f"{w}@{link}", n) for w, link, n in PAGE_SETUPS]


def _page_order(p: PageSetup) -> int:
    """Where ``p`` stands among :data:`PAGE_SETUPS` (one it does not name: after them)."""
    names = _page_names()
    return names.index(p.name) if p.name in names else len(names)


def _median_versus(p: PageSetup, other: str, *, by_mb: bool = False) -> float | None:
    """The median over the seeds of the default's time to the bar over ``other``'s (with
    ``by_mb``, ``other``'s MB to the bar over the default's); ``None`` where no seed has one."""
    mine, theirs = p.score.row(_DEFAULT), p.score.row(other)
    values = (
        versus(mb_reaches(theirs), mb_reaches(mine))
        if by_mb
        else versus(mine.reaches, theirs.reaches)
    )
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else None


def link_bound(p: PageSetup) -> bool:
    """Whether DDP's exposed communication is at least :data:`LINK_BOUND_SHARE` of its step
    on the setup's link."""
    ddp = p.runs.timing.get(DENSE, p.runs.dense[DENSE])[0]
    return float(ddp["comm_seconds"]) >= LINK_BOUND_SHARE * float(ddp["step_seconds"])


@dataclass(frozen=True)
class Goal:
    """One goal on one setup.

    Attributes:
        goal: what is asked.
        setup: the setup's name.
        measured: the median ratio (``None``: not measured).
        met: whether it is met (``None``: not measured).
    """

    goal: str
    setup: str
    measured: float | None
    met: bool | None


def goals(setups: Sequence[PageSetup]) -> list[Goal]:
    """The goals of the module docstring on every setup that ran the default and the
    baselines they need."""
    return [g for p in setups if p.score.has(_DEFAULT) for g in _setup_goals(p)]


def _setup_goals(p: PageSetup) -> list[Goal]:
    every_seed = p.score.row(_DEFAULT).reached_every_seed

    def judged(goal: str, measured: float | None, most: float | None, least: float | None) -> Goal:
        if measured is None or not every_seed:
            return Goal(goal, p.name, measured, None)
        met = (most is None or measured <= most) and (least is None or measured >= least)
        return Goal(goal, p.name, measured, met)

    out = []
    if p.score.has(_ACCORDION):
        most = 1 / SOONER_THAN_ACCORDION if p.score.setup.startswith(COMM_HEAVY) else 1.0
        out.append(
            judged(f"time <= {most:.2f}x Accordion's", _median_versus(p, _ACCORDION), most, None)
        )
        fewer = FEWER_BYTES_THAN_ACCORDION
        mb = _median_versus(p, _ACCORDION, by_mb=True)
        out.append(judged(f"MB >= {fewer:g}x fewer than Accordion", mb, None, fewer))
    if p.score.has(FP16) and link_bound(p):
        goal = f"time <= {VERSUS_FP16:g}x DDP + fp16 hook's (link-bound)"
        out.append(judged(goal, _median_versus(p, FP16), VERSUS_FP16, None))
    return out


def _cell(value: float | None) -> str:
    return "–" if value is None else ("inf" if math.isinf(value) else f"{value:.2f}")


def _summary(setups: Sequence[PageSetup]) -> list[str]:
    """One row a setup: the default's time to the bar and its median ratio to each other."""
    others = [DENSE, *BASELINES]
    lines = [
        "| setup | bar | yardstick (time to bar, s) | GraVAC default: time to bar (s), bar every "
        "seed | "
        + " | ".join(f"vs {o}" for o in others)
        + " | vs yardstick | Algorithm 1 vs yardstick | MB, Accordion / default |",
        "|---|---|---|--:|" + "--:|" * (len(others) + 3),
    ]
    for p in setups:
        if not p.score.has(_DEFAULT):
            lines.append(
                f"| {p.name} | {bar_text(p.score)} | {yardstick_text(p.score)} | not run |"
                + " |" * (len(others) + 3)
            )
            continue
        default = p.score.row(_DEFAULT)
        reached = f"{default.reached}/{len(default.reaches)}"
        cells = [_cell(_median_versus(p, o)) if p.score.has(o) else "–" for o in others]
        yard = "–" if default.ratios is None else _cell(statistics.median(default.ratios))
        paper = p.score.row(_PAPER).ratios if p.score.has(_PAPER) else None
        paper_cell = "–" if paper is None else _cell(statistics.median(paper))
        mb = _cell(_median_versus(p, _ACCORDION, by_mb=True)) if p.score.has(_ACCORDION) else "–"
        lines.append(
            f"| {p.name} | {bar_text(p.score)} | {yardstick_text(p.score)} | "
            f"{seconds_cell(default)}, {reached} | "
            + " | ".join([*cells, yard, paper_cell, mb])
            + " |"
        )
    return lines


def _goal_lines(judged: Sequence[Goal]) -> list[str]:
    lines = ["| goal | setup | measured (median ratio) | met |", "|---|---|--:|---|"]
    for g in judged:
        met = (
            "not judged: the default missed the bar on a seed"
            if g.met is None
            else ("yes" if g.met else "no")
        )
        lines.append(f"| {g.goal} | {g.setup} | {_cell(g.measured)} | {met} |")
    return lines


def _plot_summary(p: PageSetup) -> dict[str, Any]:
    """The runs the figures draw (see the module docstring), as a study's summary for
    :func:`gravac_lab.compare.plots.write_plots`, the bar as its target."""
    yard = p.score.yardstick
    runs = [
        *(r for group in p.runs.dense.values() for r in group),
        *(p.runs.statics[yard] if yard is not None else []),
        *(r for group in p.runs.searches.values() for r in group),
    ]
    return {"workload": {"target": p.score.bar, "metric": p.score.metric}, "runs": runs}


def _section(p: PageSetup, images: Sequence[tuple[str, str]]) -> list[str]:
    made = (
        "a command not stored (the scoreboard predates it)"
        if p.command is None
        else f"`{p.command}` at commit `{p.commit or 'unknown (not a git checkout)'}`"
    )
    lines = [
        f"## {p.name}",
        "",
        f"Trained by {made}.",
        "",
        *setup_detail(p.score),
    ]
    versus_rows = (
        [o for o in (DENSE, *BASELINES) if p.score.has(o)] if p.score.has(_DEFAULT) else []
    )
    if versus_rows:
        default = p.score.row(_DEFAULT)
        lines += [
            "",
            "The default search's time to the bar over each one's, seed by seed (0: only the "
            "default reached it), and each one's MB to the bar over the default's:",
            "",
            "| against | time ratio | MB ratio |",
            "|---|--:|--:|",
        ]
        for o in versus_rows:
            t, mb = versus_cells(default, p.score.row(o))
            lines.append(f"| {o} | {t} | {mb} |")
    for image, caption in images:
        lines += ["", f"![{caption}]({image})"]
    return lines


def write_page(stored: Sequence[Mapping[str, Any]], page: Path, *, draw: bool = True) -> list[Path]:
    """Write the results page at ``page`` from ``stored`` scoreboards (their JSON), and with
    ``draw`` its figures under :data:`PLOTS` beside it; the files written.

    Raises:
        ValueError: see :func:`page_setups`; ``draw`` without matplotlib.
    """
    if draw:
        plots.check_available()
    setups = sorted(page_setups(stored), key=_page_order)
    written: list[Path] = []
    sections: list[str] = []
    for p in setups:
        images: list[tuple[str, str]] = []
        if draw:
            folder = PLOTS / p.slug
            drawn = plots.write_plots(_plot_summary(p), page.parent / folder)
            written += drawn
            names = {path.name for path in drawn}
            images = [
                ((folder / plots.PLOT_FILES[f]).as_posix(), caption)
                for f, caption in _FIGURES
                if plots.PLOT_FILES[f] in names
            ]
        sections += ["", *_section(p, images)]
    shown = {p.name for p in setups}
    missing = [name for name in _page_names() if name not in shown]
    lines = [
        "# Results: time to the quality bar, GraVAC against its baselines",
        "",
        "Written by `gravac compare --scoreboard --from-json ... --report` from the stored "
        "scoreboards under `docs/results/page/`; `scripts/results.sh` trains those missing and "
        "rebuilds this page (as root: the links are shaped with `tc`). Each section names the "
        "command that trained it and its commit. The bar, the yardstick and time to the bar are "
        "the scoreboard's (`docs/controller.md`, 'The scoreboard'): dense DDP's final metric "
        "less 1 point of accuracy or plus 3% of perplexity, held for two evaluations in a row.",
        "",
        "## Summary",
        "",
        "GraVAC is the default search (`GravacOptimizer`'s defaults); a ratio is its time to the "
        "bar over the other's on the same seed, the median over the seeds (0: only GraVAC "
        "reached the bar; inf: only the other did). Algorithm 1 is the GraVAC paper's, "
        "`search=\"paper\"`. The last column is Accordion's MB to the bar over GraVAC's "
        "(inf: only GraVAC reached the bar). Setups in the issue's order: each workload at "
        "1 Gbit/s and 100 Mbit/s, then 4 workers.",
        "",
        *_summary(setups),
    ]
    if missing:
        lines += ["", f"Not yet run: {'; '.join(missing)}."]
    lines += [
        "",
        "## Goals",
        "",
        f"Against Accordion with PowerSGD as the GraVAC paper ran it: at least "
        f"{SOONER_THAN_ACCORDION:g}x sooner on {COMM_HEAVY} and no later elsewhere, with at "
        f"least {FEWER_BYTES_THAN_ACCORDION:g}x fewer bytes; at most {VERSUS_FP16:g}x the time "
        "of DDP with PyTorch's fp16 hook where the link is the bottleneck (DDP's exposed "
        f"communication at least {LINK_BOUND_SHARE:.0%} of its step on that link).",
        "",
        *_goal_lines(goals(setups)),
    ]
    reading = page.parent / READING
    if reading.is_file():  # the why of the goals, written by hand for the runs stored
        lines += ["", reading.read_text().strip()]
    lines += sections
    page.write_text("\n".join(lines) + "\n")
    return [page, *written]
