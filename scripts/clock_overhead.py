"""How far a run's own clock runs ahead of its steps times its median step, on stored scoreboards.

For every run of the stored scoreboards' dense, ladder and searches studies
(``gravac compare --scoreboard --out``'s JSON), the training seconds at its last evaluation
over that evaluation's step times the run's median step time (``step_seconds``, the median
over its timed steps), and per study role the median and range over the runs::

    python scripts/clock_overhead.py docs/results/page/*.json docs/results/scoreboard*.json

A ratio above 1 is what the run's first steps cost once and its slower steps: the part of a
run's time that a static CF's time on a shaped link drops if it is its step count times the
link's median step (``docs/results/scoreboard.md``, its last section).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["overheads", "report"]

#: the studies whose runs are read: the ones the scoreboard times by their runs' clocks
ROLES = ("dense", "ladder", "searches")


def overheads(studies: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Each run's clock at its last evaluation over that step times its median step, by role."""
    out: dict[str, list[float]] = {}
    for study in studies:
        if study["role"] not in ROLES:
            continue
        for run in study["summary"]["runs"]:
            step, seconds, _ = run["evaluations"][-1]
            out.setdefault(study["role"], []).append(seconds / (step * run["step_seconds"]))
    return out


def report(paths: Sequence[str]) -> list[str]:
    """One line a role over every scoreboard in ``paths``."""
    merged: dict[str, list[float]] = {}
    for path in paths:
        with open(path) as f:
            for role, ratios in overheads(json.load(f)["studies"]).items():
                merged.setdefault(role, []).extend(ratios)
    return [
        f"{role}: {len(v)} runs, clock / (steps x median step): median "
        f"{statistics.median(v):.3f}, range {min(v):.3f}-{max(v):.3f}"
        for role, v in merged.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="stored scoreboards (JSON)")
    print("\n".join(report(parser.parse_args().paths)))


if __name__ == "__main__":
    main()
