"""What the default search's first steps change: its run against a static CF with and without them.

The search by shadow sends the top of its ladder and ``theta_min`` for its first steps (its
warm-up) and then the CF it chooses. Where it chooses one CF and keeps it, its run is the run of
that static CF with the warm-up's CFs sent first (the fixed policy's ``warmup``), bit for bit.
This script reads one ``gravac compare`` JSON holding three variants over many seeds, the
search (``--search``), a fixed CF (``--static``) and the same CF after the search's warm-up
(``--warmed``), and prints, against the bar ``--bar`` held for two evaluations in a row
(:func:`gravac_lab.compare.scoreboard.reach`):

- on how many seeds the search sent ``warmed``'s schedule, and whether its evaluations were
  ``warmed``'s exactly there;
- the CFs the search sent after its warm-up, by how many seeds;
- each variant's steps to the bar, and ``warmed`` against ``static`` seed by seed;
- the search's and ``warmed``'s time to the bar over ``static``'s on the same seed, how many meet
  1.15, and the chance that the median of 3 seeds does
  (:func:`gravac_lab.compare.scoreboard.chance`);
- the median step time of each on the seeds where the search sent ``warmed``'s schedule.

Without ``--warmed`` it prints the search's ratio line alone, with the CFs it sent after its
warm-up (a JSON of the search and the static CF only).

(``docs/studies/2026-12-07-warmup-trajectory.md``)::

    python scripts/warmup_trajectory.py docs/results/warmup/vgg-digits-loopback-36.json \\
        --bar 0.9733 --search default --static cf160 --warmed warm160
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gravac.control.options import ControllerConfig
from gravac_lab.compare.scoreboard import TARGET_RATIO, Reach, chance, reach

__all__ = ["report"]

#: seeds of the scoreboard's median
BOARD_SEEDS = 3
#: the search by shadow's warm-up at the default ``warmup_steps`` (which gravac compare keeps)
#: and its bridge: the steps after which the CFs sent are the search's choices
WARMUP_STEPS = ControllerConfig.warmup_steps + 1

#: what a run's reach of the bar is compared by, from its seconds and its step
Measure = Callable[[float, int], float]


def _time(seconds: float, step: int) -> float:
    return seconds


#: the measures of the breakdown by the search's CFs: time, steps, seconds a step
_MEASURES: dict[str, Measure] = {
    "time": _time,
    "steps": lambda seconds, step: step,
    "seconds a step": lambda seconds, step: seconds / step,
}


def _step_ms(runs: Sequence[Mapping[str, Any]]) -> float:
    return statistics.median(r["step_seconds"] for r in runs) * 1e3


def report(
    runs: Sequence[Mapping[str, Any]], bar: float, search: str, static: str, warmed: str
) -> list[str]:
    """The lines the module docstring lists, for ``runs`` (a compare JSON's ``runs``) and the
    variants labelled ``search``, ``static`` and ``warmed``."""
    by = _by_variant(runs)
    seeds = sorted(by[static])
    at = _reaches(by, bar, seeds)
    sent = {v: {s: by[v][s]["cf_sent_by_step"] for s in seeds} for v in (search, warmed)}
    same = [s for s in seeds if sent[search][s] == sent[warmed][s][: len(sent[search][s])]]
    identical = [
        s
        for s in same
        if [e[2] for e in by[search][s]["evaluations"]]
        == [e[2] for e in by[warmed][s]["evaluations"]]
    ]
    schedule = sent[warmed][seeds[0]]
    warmup = max(i + 1 for i, cf in enumerate(schedule) if cf != schedule[-1])
    after = Counter(_sent_after(sent[search][s], warmup) for s in seeds)
    lines = [
        f"seeds: {len(seeds)}; {search} sent {warmed}'s schedule on {len(same)}, "
        f"with {warmed}'s evaluations exactly on {len(identical)}",
        f"{search}'s CFs after step {warmup}: "
        + "; ".join(f"{cfs}: {n} seeds" for cfs, n in after.most_common()),
    ]
    steps = {v: [at[v][s].step for s in seeds] for v in by}
    for v, st in steps.items():
        got = [x for x in st if x is not None]
        lines.append(
            f"{v}: steps to the bar median {statistics.median(got)}, "
            f"mean {statistics.mean(got):.1f}, {min(got)}-{max(got)}, "
            f"reached on {len(got)} of {len(st)}"
        )
    diff = [
        a - b
        for a, b in zip(steps[warmed], steps[static], strict=True)
        if a is not None and b is not None
    ]
    lines.append(
        f"{warmed} against {static}, seed by seed: more steps on {sum(x > 0 for x in diff)}, "
        f"fewer on {sum(x < 0 for x in diff)}, as many on {sum(x == 0 for x in diff)}"
    )
    lines += [_ratio_line(at, seeds, v, static) for v in (search, warmed)]
    for cfs, n in after.most_common():
        group = [s for s in seeds if _sent_after(sent[search][s], warmup) == cfs]
        medians = (
            f"{name} {statistics.median(_over(at[search][s], at[static][s], m) for s in group):.2f}"
            for name, m in _MEASURES.items()
        )
        lines.append(
            f"{search} where it sent {cfs} after step {warmup} ({n} seeds), over {static}: "
            + ", ".join(medians)
        )
    lines.append(
        f"median step ms on the {len(same)} seeds of {warmed}'s schedule: "
        + ", ".join(
            f"{v} {_step_ms([by[v][s] for s in same]):.1f}" for v in (search, warmed, static)
        )
    )
    return lines


def against(runs: Sequence[Mapping[str, Any]], bar: float, search: str, static: str) -> str:
    """The search's time to the bar over ``static``'s alone (no ``warmed`` variant): the ratio
    line of :func:`report`, with the CFs it sent after its warm-up (steps 0-10)."""
    by = _by_variant(runs)
    seeds = sorted(by[static])
    after = Counter(_sent_after(by[search][s]["cf_sent_by_step"], WARMUP_STEPS) for s in seeds)
    return "\n".join(
        [
            _ratio_line(_reaches(by, bar, seeds), seeds, search, static),
            f"{search}'s CFs after step {WARMUP_STEPS}: "
            + "; ".join(f"{cfs}: {n} seeds" for cfs, n in after.most_common()),
        ]
    )


def _by_variant(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, Mapping[str, Any]]]:
    by: dict[str, dict[int, Mapping[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    return by


def _reaches(
    by: Mapping[str, Mapping[int, Mapping[str, Any]]], bar: float, seeds: Sequence[int]
) -> dict[str, dict[int, Reach]]:
    return {v: {s: reach(by[v][s], bar, higher_is_better=True) for s in seeds} for v in by}


def _ratio_line(
    at: Mapping[str, Mapping[int, Reach]], seeds: Sequence[int], v: str, static: str
) -> str:
    ratio = [_over(at[v][s], at[static][s], _time) for s in seeds]
    held = sum(at[v][s].seconds is not None for s in seeds)
    return (
        f"{v} / {static}, time to the bar: median {statistics.median(ratio):.2f}, "
        f"<= {TARGET_RATIO} on {sum(x <= TARGET_RATIO for x in ratio)} of {len(ratio)}, "
        f"chance the median of {BOARD_SEEDS} seeds meets it {chance(ratio, BOARD_SEEDS):.2f}, "
        f"bar held on {held} of {len(seeds)}"
    )


def _sent_after(cfs: Sequence[float], step: int) -> str:
    """The CFs of ``cfs`` after its first ``step``, in order of size."""
    return ", ".join(f"{cf:g}" for cf in sorted(set(cfs[step:])))


def _over(run: Reach, base: Reach, measure: Measure) -> float:
    """``run``'s ``measure`` of its reach of the bar over ``base``'s; ``inf`` where either did
    not reach it."""
    if run.seconds is None or base.seconds is None or run.step is None or base.step is None:
        return float("inf")
    return measure(run.seconds, run.step) / measure(base.seconds, base.step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("path", help="a gravac compare --out JSON with those variants")
    parser.add_argument("--bar", type=float, required=True, help="the accuracy bar")
    parser.add_argument("--search", default="default", help="the search's variant label")
    parser.add_argument("--static", required=True, help="the fixed CF's variant label")
    parser.add_argument(
        "--warmed", help="that CF after the search's warm-up (without: the ratio alone)"
    )
    args = parser.parse_args()
    with open(args.path) as f:
        runs = json.load(f)["runs"]
    if args.warmed is None:
        print(against(runs, args.bar, args.search, args.static))
    else:
        print("\n".join(report(runs, args.bar, args.search, args.static, args.warmed)))


if __name__ == "__main__":
    main()
