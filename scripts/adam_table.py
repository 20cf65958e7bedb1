"""Adam against SGD under compression (``docs/studies/2026-12-04-adam.md``): per ``gravac
compare`` study of modes ``ddp,gravac`` (one JSON per workload and optimizer), dense DDP's final
metric and the default search's, their difference, the steps each seed took to the workload's
target, and the CF the search sent most::

    python scripts/adam_table.py docs/results/adam
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _steps(runs: list[dict[str, Any]]) -> str:
    steps = (r["steps_to_target"] for r in runs)
    return "/".join("-" if s is None else str(s) for s in steps)


def row(path: Path) -> str:
    """One study's line of the table (the study named by its file)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for run in json.loads(path.read_text())["runs"]:
        by.setdefault(run["mode"], []).append(run)
    final = {m: statistics.median(r["final_metric"] for r in rs) for m, rs in by.items()}
    cfs = [c for r in by["gravac"] for c in r["cf_sent_by_step"] if c]
    return (
        f"| {path.stem} | {final['ddp']:.4f} | {final['gravac']:.4f} | "
        f"{final['gravac'] - final['ddp']:+.4f} | {_steps(by['ddp'])} / {_steps(by['gravac'])} | "
        f"{statistics.median(cfs):g} |"
    )


if __name__ == "__main__":
    print("| study | dense DDP final | gravac final | gravac - dense | steps to target | CF |")
    print("|---|--:|--:|--:|--:|--:|")
    for found in sorted(Path(sys.argv[1]).glob("*.json")):
        print(row(found))
