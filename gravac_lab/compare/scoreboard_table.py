"""The scoreboard as markdown: a header, one line a setup, then each setup's every row.

:func:`format_scoreboard` lays out what :func:`gravac_lab.compare.scoreboard.score` judged from a
stored scoreboard (``{"scoreboard": settings, "studies": [...]}``), so that the table printed
after training and the one rebuilt from the JSON (``--from-json``) are the same text.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from gravac_lab.compare.scoreboard import (
    ACCURACY_POINT,
    DENSE,
    PERPLEXITY_SHARE,
    TARGET_RATIO,
    TWIN_SUFFIX,
    Row,
    SetupScore,
    chance,
    chance_at_least,
    score,
    spread,
    twin_ratios,
    versus,
    versus_sent,
)

__all__ = [
    "bar_text",
    "format_scoreboard",
    "mb_reaches",
    "seconds_cell",
    "sent_lines",
    "setup_detail",
    "twins_lines",
    "versus_cells",
    "yardstick_text",
]

#: percent in a fraction
_PERCENT = 100


def _number(value: float, digits: int) -> str:
    return "–" if math.isinf(value) else f"{value:.{digits}f}"


def _spread_cell(values: Sequence[float], digits: int) -> str:
    """The median, and the range in brackets where the values differ as printed."""
    median, low, high = (_number(v, digits) for v in spread(values))
    return median if low == high else f"{median} ({low}-{high})"


def seconds_cell(row: Row) -> str:
    return _spread_cell([math.inf if r.seconds is None else r.seconds for r in row.reaches], 1)


def _ratio(row: Row) -> str:
    return "–" if row.ratios is None else _spread_cell(row.ratios, 2)


def _reached(row: Row) -> str:
    mark = "yes" if row.reached_every_seed else "no"
    return f"{mark} ({row.reached}/{len(row.reaches)})"


def _mb(row: Row) -> str:
    known = [r.mb for r in row.reaches if r.mb is not None]
    return _spread_cell(known, 1) if known else "–"


def bar_text(s: SetupScore) -> str:
    direction = ">=" if s.higher_is_better else "<="
    return f"{s.metric} {direction} {s.bar:.4f}"


def yardstick_text(s: SetupScore) -> str:
    if s.yardstick is None:
        return "none reached the bar on every seed"
    return f"{s.yardstick}, {seconds_cell(s.row(s.yardstick))} s"


def _header(settings: Mapping[str, Any]) -> list[str]:
    seeds = ", ".join(map(str, settings["seeds"]))
    ladder = ", ".join(f"{cf:g}" for cf in settings["ladder"])
    milestones = settings.get("lr_milestones") or []
    schedule = (
        f"; the learning rate x {settings['lr_gamma']:g} after steps "
        f"{', '.join(map(str, milestones))}"
        if milestones
        else ""
    )
    nodes = settings.get("nodes", 1)  # absent from the JSON of scoreboards before nodes
    # absent from the JSON of scoreboards before the searches trained seed by seed beside the
    # static CFs, which timed the static CFs on a link on one seed
    interleaved = settings.get("interleaved", False)
    timed_when = (
        "the same seed, just before that seed's searches"
        if interleaved
        else f"seed {settings['timing_seed']}"
    )
    searched_when = (
        "; on loopback in the ladder's study, each seed's after its static CFs"
        if interleaved
        else ""
    )
    in_nodes = f" in {nodes} nodes" if nodes > 1 else ""
    lines = [
        f"- setups: {', '.join(s['name'] for s in settings['setups'])}; "
        f"{settings['workers']} workers{in_nodes} x batch {settings['batch_size']}; "
        f"seeds {seeds}{schedule}",
        f"- the bar: dense DDP's final metric after {settings['steps']} steps (median over the "
        f"seeds) less {ACCURACY_POINT * _PERCENT:g} point of accuracy, or plus "
        f"{PERPLEXITY_SHARE * _PERCENT:g}% of perplexity. Time to the bar: training seconds "
        f"(evaluation excluded) until the first evaluation (every {settings['eval_every']} "
        f"steps) from which {settings['hold']} in a row meet it; the static CFs and the "
        f"searches train up to {settings['compressed_steps']} steps",
        f"- the yardstick: the fastest static CF of {ladder} (Top-k; median time to the bar) "
        "among those that reach the bar on every seed",
        "- ratio: a run's time to the bar over the yardstick's on the same seed; median over "
        "the seeds (range in brackets; – where the bar was not reached); searches: "
        + "; ".join(f"`{spec}`" for spec in settings["searches"]),
        "- timing: dense DDP and the static CFs do not read the clock, so their metric per step "
        "does not depend on the link: each trained once per seed on loopback; on a shaped link "
        "their time to the bar is their own clock on loopback plus, for each step, their median "
        f"step time in a run of {settings['timing_steps']} steps on that link "
        f"({timed_when}) less their median step on loopback. "
        "The searches, whose decisions read the link, trained on each link, timed by their own "
        f"clock{searched_when}",
        "- MB: what a rank sent until the bar (median over the seeds that reached it)",
    ]
    if settings.get("baselines"):
        lines += _BASELINE_HEADER
    if settings.get("twins"):
        lines.append(_TWINS_HEADER)
    return lines + _provenance(settings)


def _provenance(settings: Mapping[str, Any]) -> list[str]:
    """The header's line on the command and commit that trained it, where stored (a
    scoreboard stored before they were has neither)."""
    if "command" not in settings:
        return []
    commit = settings["commit"] or "not a git checkout"
    return [f"- made by: `{settings['command']}` (commit {commit})"]


#: the header's line on the baselines, where they trained
_BASELINE_HEADER = [
    "- baselines: DDP with PyTorch's fp16 hook (`ddp-fp16`, trained and timed as dense DDP), "
    "and Accordion as the GraVAC paper ran it (`accordion`: PowerSGD at rank 4 in critical "
    "regimes, 1 otherwise; trained on each link, as the searches)",
]


def _summary(scores: Sequence[SetupScore]) -> list[str]:
    searches = list(dict.fromkeys(r.label for s in scores for r in s.rows if r.kind == "search"))
    lines = [
        "| setup | bar | yardstick (time to bar) | "
        + " | ".join(f"{label}: ratio, bar every seed" for label in searches)
        + " |",
        "|---|---|---|" + "--:|" * len(searches),
    ]
    for s in scores:
        cells = []
        for label in searches:
            try:
                row = s.row(label)
            except KeyError:
                cells.append("")
                continue
            cells.append(f"{_ratio(row)}, {_reached(row)}")
        lines.append(
            f"| {s.setup} | {bar_text(s)} | {yardstick_text(s)} | " + " | ".join(cells) + " |"
        )
    return lines


def sent_lines(scores: Sequence[SetupScore]) -> list[str]:
    """Each search against the static CF it sent most, seed by seed
    (:func:`gravac_lab.compare.scoreboard.versus_sent`): which CF, and its time to the bar over
    that CF's static run's. A ratio to the yardstick above 1.15 with this one near 1 is a
    choice of CF; with this one above 1 too, the search ran its CF slower. Empty where no
    search logged its CFs."""
    shown = [(s, label) for s in scores for label in s.sent if any(s.sent[label])]
    if not shown:
        return []
    lines = [
        "**Each search against the static CF it sent most**: on each seed the CF it sent at the "
        "most steps, and its time to the bar over that static CF's on the same seed (median, "
        "range; – where that CF is not on the ladder).",
        "",
        "| setup | search | CF sent most, by seed | time over that CF's |",
        "|---|---|---|--:|",
    ]
    for s, label in shown:
        cfs = ", ".join(cf or "–" for cf in s.sent[label])
        lines.append(f"| {s.setup} | {label} | {cfs} | {_versus_cell(versus_sent(s, label))} |")
    return lines


#: the search set against the baselines
_DEFAULT = "default"


def versus_cells(mine: Row, theirs: Row) -> list[str]:
    """``mine``'s time to the bar over ``theirs``' and ``theirs``' MB to the bar over ``mine``'s,
    seed by seed, as two cells."""
    return [
        _versus_cell(versus(mine.reaches, theirs.reaches)),
        _versus_cell(versus(mb_reaches(theirs), mb_reaches(mine))),
    ]


def _versus_cell(values: Sequence[float]) -> str:
    """Ratios over the seeds where both runs ran and one reached the bar (``0``: only the
    search did; ``–``: none)."""
    known = [v for v in values if not math.isnan(v)]
    return _spread_cell(known, 2) if known else "–"


def _baselines(scores: Sequence[SetupScore]) -> list[str]:
    """The default search's time to the bar over each baseline's (DDP's too), seed by seed,
    and the MB the faithful Accordion sent to the bar over the default's; empty where no
    setup has both."""
    shown = [s for s in scores if any(r.kind == "baseline" for r in s.rows)]
    if not shown or not all(s.has(_DEFAULT) for s in shown):
        return []
    baselines = dict.fromkeys(r.label for s in shown for r in s.rows if r.kind == "baseline")
    others = [DENSE, *baselines]
    lines = [
        "**The default search against the baselines**: its time to the bar over each one's "
        "on the same seed (median, range; 0 where only the search reached it), and the MB "
        "the baseline sent to the bar over the search's.",
        "",
        "| setup | " + " | ".join(f"time vs {o} | MB, {o} / default" for o in others) + " |",
        "|---|" + "--:|--:|" * len(others),
    ]
    for s in shown:
        mine = s.row(_DEFAULT)
        cells = []
        for o in others:
            if not s.has(o):
                cells += ["", ""]
                continue
            cells += versus_cells(mine, s.row(o))
        lines.append(f"| {s.setup} | " + " | ".join(cells) + " |")
    return lines


#: the twins' header line, where they trained
_TWINS_HEADER = (
    "- twins: every static CF trained again on loopback, each rank drawing other batches from "
    "the same shard, from the same initial weights, and timed as its CF; a twin's ratio is its "
    "time to the bar over its CF's on the same seed: what a run as good as that CF scores by "
    "luck alone"
)


def _odds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def twins_lines(scores: Sequence[SetupScore], seeds: int) -> list[str]:
    """The twins' table: per setup, the yardstick's twin's ratio, every CF's twin's, the share
    of them at most :data:`TARGET_RATIO`, the chance (:func:`chance`) that the median over
    ``seeds`` seeds of a run as good as a CF meets it, and the chance that such a run's median
    is at least the default search's (:func:`chance_at_least`: whether luck alone explains the
    default's ratio); then the chance that such runs meet the bound on every setup (the
    product, the setups taken as independent). Empty where no twin trained."""
    shown = [(s, twin_ratios(s)) for s in scores]
    shown = [(s, twins) for s, twins in shown if twins]
    if not shown:
        return []
    lines = [
        f"| setup | yardstick | its twin: ratio | every CF's twin: ratio | twins <= "
        f"{TARGET_RATIO:g} | chance the median of {seeds} meets {TARGET_RATIO:g} | chance it "
        f"is the {_DEFAULT} search's or more |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    every: float | None = 1.0
    for s, twins in shown:
        pooled = [v for values in twins.values() for v in values if not math.isnan(v)]
        own = twins.get(s.yardstick) if s.yardstick is not None else None
        own_cell = "–" if not own else _spread_cell(own, 2)
        met = sum(v <= TARGET_RATIO for v in pooled)
        judged = bool(pooled) and seeds % 2 == 1
        odds = chance(pooled, seeds) if judged else None
        every = None if every is None or odds is None else every * odds
        default = s.row(_DEFAULT).ratios if s.has(_DEFAULT) else None
        worse = (
            chance_at_least(pooled, seeds, statistics.median(default))
            if judged and default
            else None
        )
        lines.append(
            f"| {s.setup} | {s.yardstick or '–'}{TWIN_SUFFIX if own else ''} | {own_cell} | "
            f"{_spread_cell(pooled, 2) if pooled else '–'} | {met} of {len(pooled)} | "
            f"{_odds(odds)} | {_odds(worse)} |"
        )
    if every is not None and len(shown) > 1:
        lines += [
            "",
            f"The chance that runs as good as a CF meet {TARGET_RATIO:g} on all {len(shown)} "
            f"setups above (the product; the setups taken as independent): {every:.2f}",
        ]
    return lines


def mb_reaches(row: Row) -> list[Any]:
    """``row``'s reaches with their MB to the bar in place of their seconds (for
    :func:`versus`)."""
    return [dataclasses.replace(r, seconds=r.mb) for r in row.reaches]


def setup_detail(s: SetupScore) -> list[str]:
    """A setup's bar, yardstick and link, then one table row a run, as markdown lines."""
    lines = [
        f"Bar: {bar_text(s)}. Yardstick: {yardstick_text(s)}. Searches' link: {s.network}.",
        "",
        f"| run | kind | time to bar (s) | ratio | bar every seed | MB to bar | final {s.metric} |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for row in s.rows:
        final = _spread_cell([r.final_metric for r in row.reaches], 4)
        lines.append(
            f"| {row.label} | {row.kind} | {seconds_cell(row)} | {_ratio(row)} | {_reached(row)} "
            f"| {_mb(row)} | {final} |"
        )
    return lines


def format_scoreboard(stored: Mapping[str, Any]) -> str:
    """A stored scoreboard as markdown (setups not yet complete are left out, and named)."""
    scores = score(stored)
    lines = _header(stored["scoreboard"])
    done = {s.setup for s in scores}
    unfinished = [s["name"] for s in stored["scoreboard"]["setups"] if s["name"] not in done]
    if unfinished:
        lines.append(f"- not finished (their studies are not all stored): {', '.join(unfinished)}")
    lines += ["", *_summary(scores)]
    sent = sent_lines(scores)
    if sent:
        lines += ["", *sent]
    versus_lines = _baselines(scores)
    if versus_lines:
        lines += ["", *versus_lines]
    twin_table = twins_lines(scores, len(stored["scoreboard"]["seeds"]))
    if twin_table:
        lines += ["", *twin_table]
    for s in scores:
        lines += ["", f"### {s.setup}", "", *setup_detail(s)]
    return "\n".join(lines)
