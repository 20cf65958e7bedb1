"""Each gravac variant's final metric against dense DDP's on the same seed, from ``gravac
compare`` JSON (``docs/studies/2026-12-04-adam.md``): per file, per run of modes ``ddp`` and
``gravac``, the final test metric by seed, its excess over dense DDP's on that seed (relative:
perplexity; absolute: accuracy) and what the variant sent a step against a float32 all-reduce::

    python scripts/variant_excess.py docs/results/adam/quantizers/*.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from gravac_lab.compare.scoreboard import by_label

__all__ = ["excess", "rows"]


def excess(metric: float, dense: float, perplexity: bool) -> str:
    """``metric`` over ``dense``: in percent of ``dense`` for a perplexity, else in points."""
    if perplexity:
        return f"{100 * (metric / dense - 1):+.1f}%"
    return f"{metric - dense:+.4f}"


def rows(study: dict[str, Any]) -> list[str]:
    """The table's lines for one ``gravac compare`` study (dense DDP first, if it ran)."""
    perplexity = "perplexity" in study["workload"]["metric"]
    dense = {r["seed"]: r["final_metric"] for r in study["runs"] if r["mode"] == "ddp"}
    out = []
    for label, runs in by_label(study["runs"]).items():
        finals = " / ".join(f"{r['final_metric']:.4f}" for r in runs)
        over = " / ".join(
            excess(r["final_metric"], dense[r["seed"]], perplexity) if r["seed"] in dense else "-"
            for r in runs
        )
        ratio = statistics.median(
            r["dense_wire_bytes_per_step"] / r["wire_bytes_per_step"] for r in runs
        )
        out.append(f"| {label} | {finals} | {over} | {ratio:.1f}x |")
    return out


if __name__ == "__main__":
    for name in sys.argv[1:]:
        found = json.loads(Path(name).read_text())
        print(f"\n{name}: {found['workload']['name']}, {found['config'].get('optimizer', 'sgd')}")
        print("| run | final (seeds in order) | over dense DDP | reduction |")
        print("|---|---|---|--:|")
        print("\n".join(rows(found)))
