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

from gravac_lab.compare.scoreboard import Row, score_setup

#: where the results page's scoreboards lie (their dense, ladder and timing studies)
PAGE = Path(__file__).resolve().parents[1] / "docs" / "results" / "page"


def _seconds(row: Row) -> list[float | None]:
    return [r.seconds for r in row.reaches]


def _over(a: list[float | None], b: list[float | None]) -> list[float]:
    """Seed by seed, ``a / b`` (NaN where either did not reach the bar)."""
    return [x / y if x and y else float("nan") for x, y in zip(a, b, strict=True)]


def _cells(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({' / '.join(f'{v:.2f}' for v in values)})"


def report(path: Path) -> list[str]:
    """The lines of one setup's study: per variant, seeds reaching the bar, time over the
    default's, time over the page's yardstick, median MB sent a rank."""
    workload, link = path.stem.rsplit("-", 1)
    ab: dict[str, Any] = json.loads(path.read_text())
    page = json.loads((PAGE / f"{workload}.json").read_text())
    studies = [s for s in page["studies"] if not (s["role"] == "searches" and s["link"] == link)]
    studies.append({"role": "searches", "workload": workload, "link": link, "summary": ab})
    score = score_setup(studies, workload, link)
    default = _seconds(score.row("default"))
    lines = [f"## {score.setup}: bar {score.bar:.4f}, yardstick {score.yardstick}"]
    labels = sorted({run["variant"] for run in ab["runs"]}, key=lambda v: v != "default")
    for label in labels:
        row = score.row(label)
        mb = [run["wire_bytes"] / 1e6 for run in ab["runs"] if run["variant"] == label]
        lines.append(
            f"{label}: bar reached {row.reached}/{len(row.reaches)}; time over the default's "
            f"{_cells(_over(_seconds(row), default))}; over the yardstick "
            f"{_cells(list(row.ratios or ()))}; MB sent {statistics.median(mb):.0f}"
        )
    return lines


if __name__ == "__main__":
    for found in sorted(Path(sys.argv[1]).glob("*-*.json")):
        print("\n".join(report(found)))
