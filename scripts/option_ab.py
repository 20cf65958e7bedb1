"""The search options' A/B (``docs/studies/2026-12-04-search-options.md``): each variant's time
to the quality bar over the default's on the same seed, from ``gravac compare`` studies of the
searches (one per setup, named ``WORKLOAD-LINK.json``), scored against the bar and yardstick of
the results page's scoreboards (``docs/results/page/WORKLOAD.json``)::

    python scripts/option_ab.py docs/results/controller/options
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gravac_lab.compare import workloads
from gravac_lab.compare.scoreboard import reach, score_setup

#: where the results page's scoreboards lie (their dense, ladder and timing studies)
PAGE = Path(__file__).resolve().parents[1] / "docs" / "results" / "page"


def _cells(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{statistics.median(values):.2f} ({' / '.join(f'{v:.2f}' for v in values)})"


def _over(a: dict[int, float | None], b: dict[int, float | None]) -> list[float]:
    """Seed by seed (the seeds of ``a`` that ``b`` has), ``a / b`` (NaN where either did not
    reach the bar)."""
    return [x / y if x and y else float("nan") for s, x in a.items() if s in b for y in [b[s]]]


def report(path: Path) -> list[str]:
    """The lines of one setup's study: per variant, seeds reaching the bar, time over the
    default's, time over the page's yardstick (on the seeds the page ran), median MB sent a
    rank."""
    workload, link = path.stem.rsplit("-", 1)
    ab: dict[str, Any] = json.loads(path.read_text())
    page = json.loads((PAGE / f"{workload}.json").read_text())
    score = score_setup(page["studies"], workload, link)
    yard = {} if score.yardstick is None else score.row(score.yardstick).reaches
    yard_seconds = {r.seed: r.seconds for r in yard}
    higher = workloads.get(workload).higher_is_better
    lines = [f"## {score.setup}: bar {score.bar:.4f}, yardstick {score.yardstick}"]
    labels = sorted({run["variant"] for run in ab["runs"]}, key=lambda v: v != "default")
    seconds = {
        label: {
            run["seed"]: reach(run, score.bar, higher).seconds
            for run in ab["runs"]
            if run["variant"] == label
        }
        for label in labels
    }
    for label in labels:
        mb = [run["wire_bytes"] / 1e6 for run in ab["runs"] if run["variant"] == label]
        reached = sum(v is not None for v in seconds[label].values())
        lines.append(
            f"{label}: bar reached {reached}/{len(seconds[label])}; time over the default's "
            f"{_cells(_over(seconds[label], seconds['default']))}; over the yardstick "
            f"{_cells(_over(seconds[label], yard_seconds))}; MB sent {statistics.median(mb):.0f}"
        )
    return lines


if __name__ == "__main__":
    for found in sorted(Path(sys.argv[1]).glob("*-*.json")):
        print("\n".join(report(found)))
