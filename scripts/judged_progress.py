"""How well the default search's judged gains foretell the static CFs' steps to the bar.

The search by shadow ranks a CF by its compression throughput, its system throughput times the
progress per step its judged window gain predicts (the gain itself:
:func:`gravac.control.window.predicted_progress`). On a scoreboard every CF of the ladder also
trained as a static CF, so the prediction can be set against what each CF did: for each setup
of each stored scoreboard (:func:`gravac_lab.compare.scoreboard.score`), this prints per static
CF its median steps to the bar over the seeds, its progress (the fewest steps of any CF over its
own, so 1 for that CF), and the search's median judged gain of that CF over its decisions after
its warm-up and before that fewest number of steps (while the decisions count), on every seed,
with the gain relative to that of the CF with the fewest steps beside it. A CF that missed the
bar on a seed counts the run's last step there. A ``gravac compare`` study of static CFs
(variants labelled ``cfN``) beside the search over more seeds is read the same way, against
``--bar``; ``--statics`` adds the static CFs of another study of the same seeds to it.

``--ranks W`` asks what the gains would have been with the held-back energy counted by the
signal share of the ``W`` ranks' aggregate, not of one rank's gradient: each rank's window sum
is one expected sum ``G`` plus its own noise (:mod:`gravac.control.noise`), so the aggregate's
share is ``W f / (1 + (W - 1) f)`` for one rank's ``f`` (:func:`aggregate_share`), and each
logged gain ``g``, judged as ``1 - (1 - e) s`` with the share ``s`` the search used (the
largest ``f`` so far, at least :data:`gravac.control.searches.shadow.MIN_SIGNAL_SHARE`), is
judged again as ``1 - (1 - e) a(s)`` (:func:`rejudged`). The runs' decisions stay as they were.

(``docs/studies/2026-12-07-judged-progress.md``)::

    python scripts/judged_progress.py docs/results/scoreboard-interleaved-lstm-1gbit.json
    python scripts/judged_progress.py docs/results/twelve/vgg-digits-loopback-12-step-timing.json \\
        --bar 0.9733
    python scripts/judged_progress.py docs/results/twelve/vgg-digits-4w-12-search.json \\
        --statics docs/results/twelve/vgg-digits-4w-12.json --bar 0.9705 --search h1
    python scripts/judged_progress.py docs/results/scoreboard-interleaved-4w.json --ranks 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gravac.control.searches.shadow import MIN_SIGNAL_SHARE
from gravac.control.tables import cf_key
from gravac_lab.compare import workloads
from gravac_lab.compare.scoreboard import Reach, by_label, reach, score, setup_runs

__all__ = ["aggregate_share", "judged_gains", "rejudged", "report", "table"]

#: the first step whose judged table counts: the warm-up's table (its last step, 10, or its bridge)
#: precedes any CF's own run
FIRST_JUDGED = 11


def judged_gains(runs: Sequence[Mapping[str, Any]], until: float) -> dict[float, float]:
    """The median judged gain of each CF over the runs' tables (``judged_by_step``) from step
    :data:`FIRST_JUDGED` to before ``until``, by CF; NaN entries (not yet judged) left out, and
    runs stored before the tables were logged hold none."""
    gains: dict[float, list[float]] = {}
    for run in runs:
        for step, table in enumerate(run.get("judged_by_step", [])):
            if table and FIRST_JUDGED <= step < until:
                for cf, (gain, _) in table.items():
                    if not math.isnan(gain):
                        gains.setdefault(cf_key(float(cf)), []).append(gain)
    return {cf: statistics.median(values) for cf, values in sorted(gains.items())}


def aggregate_share(share: float, ranks: int) -> float:
    """The signal share of the sum of ``ranks`` ranks' window gradients whose own share is
    ``share``: ``||G||^2 / (||G||^2 + E||N||^2 / W) = W f / (1 + (W - 1) f)``."""
    return ranks * share / (1 + (ranks - 1) * share)


def rejudged(run: Mapping[str, Any], ranks: int) -> dict[str, Any]:
    """``run`` with each logged judged gain counted again by the :func:`aggregate_share` of the
    share the search used at that step (the largest ``signal_by_step`` so far, at least
    :data:`~gravac.control.searches.shadow.MIN_SIGNAL_SHARE`): ``1 - (1 - g) a(s) / s``;
    tables before the first share, which judged the gains themselves, stay as they were."""
    signals = run.get("signal_by_step", [])
    largest: float | None = None
    tables = []
    for step, table in enumerate(run.get("judged_by_step", [])):
        share = signals[step] if step < len(signals) else None
        if share is not None:
            largest = share if largest is None else max(largest, share)
        if table and largest is not None:
            used = max(largest, MIN_SIGNAL_SHARE)
            scale = aggregate_share(used, ranks) / used
            table = {cf: [1 - (1 - gain) * scale, tput] for cf, (gain, tput) in table.items()}
        tables.append(table)
    return {**run, "judged_by_step": tables}


def table(
    title: str,
    statics: Mapping[float, Sequence[Reach]],
    search: Sequence[Mapping[str, Any]],
    last: int,
) -> list[str]:
    """The markdown lines of one setup: per static CF (``statics``: its reaches of the bar by
    seed, by CF), its median steps to the bar (``last`` where missed), its progress, the judged
    gain of it by the ``search``'s runs until the fewest steps (:func:`judged_gains`), and that
    gain over the one of the CF with the fewest steps."""
    steps = {
        cf: statistics.median(r.step if r.step is not None else last for r in reaches)
        for cf, reaches in statics.items()
    }
    best = min(steps, key=lambda cf: steps[cf])
    judged = judged_gains(search, steps[best])
    lines = [
        f"### {title}",
        "",
        "| CF | steps to the bar | progress | judged gain | over the fewest steps' CF's |",
        "|---|--:|--:|--:|--:|",
    ]
    for cf, n in steps.items():
        gain = judged.get(cf, math.nan)
        lines.append(
            f"| cf{cf:g} | {n:g} | {steps[best] / n:.2f} | {gain:.3f} | "
            f"{gain / judged.get(best, math.nan):.2f} |"
        )
    return [*lines, ""]


def _cf(label: str) -> float:
    """The CF of a static CF's label (``cf160``)."""
    return cf_key(float(label.removeprefix("cf")))


def _judged(runs: Sequence[Mapping[str, Any]], ranks: int | None) -> list[Mapping[str, Any]]:
    return list(runs) if ranks is None else [rejudged(r, ranks) for r in runs]


def report(
    stored: Mapping[str, Any], search: str, bar: float | None = None, ranks: int | None = None
) -> list[str]:
    """The tables (:func:`table`) of ``stored``, judged by ``search``: each setup of a stored
    scoreboard, or a ``gravac compare`` study whose static CFs are its variants labelled
    ``cfN``, against ``bar`` (the scoreboard's own bar where it is one); with ``ranks``, the
    search's gains counted by the aggregate's share (:func:`rejudged`).

    Raises:
        ValueError: a study without ``bar``.
    """
    if "scoreboard" in stored:
        studies, last = stored["studies"], int(stored["scoreboard"]["compressed_steps"])
        lines = []
        for s in score(stored):
            workload, _, link = s.setup.partition("@")
            runs = setup_runs(studies, workload, None if link == "loopback" else link)
            statics = {_cf(r.label): r.reaches for r in s.rows if r.kind == "static"}
            lines += table(s.setup, statics, _judged(runs.searches[search], ranks), last)
        return lines
    if bar is None:
        raise ValueError("--bar is needed for a study that is not a scoreboard")
    higher = workloads.get(stored["workload"]["name"]).higher_is_better
    labelled = by_label(stored["runs"])
    statics = {
        _cf(label): tuple(reach(r, bar, higher) for r in group)
        for label, group in labelled.items()
        if label.startswith("cf")
    }
    title = f"{stored['workload']['name']}, {len(labelled[search])} seeds"
    return table(title, statics, _judged(labelled[search], ranks), int(stored["config"]["steps"]))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="stored scoreboards or studies")
    parser.add_argument("--search", default="default", help="the search's label")
    parser.add_argument("--bar", type=float, help="the bar of a study that is not a scoreboard")
    parser.add_argument(
        "--statics",
        type=Path,
        help="a study whose runs (its static CFs) join each study's: the same seeds, trained apart",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        help="judge the gains again with the signal share of this many ranks' aggregate",
    )
    args = parser.parse_args(argv)
    if args.ranks is not None and args.ranks < 1:
        parser.error(f"--ranks must be an integer >= 1, got {args.ranks}")
    extra = [] if args.statics is None else json.loads(args.statics.read_text())["runs"]
    for path in args.files:
        stored = json.loads(path.read_text())
        if extra:
            stored = {**stored, "runs": [*extra, *stored["runs"]]}
        print(f"## {path}\n")
        print("\n".join(report(stored, args.search, args.bar, args.ranks)))


if __name__ == "__main__":
    main()
