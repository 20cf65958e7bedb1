"""How far a static CF chosen without hindsight is from the scoreboard's yardstick.

The scoreboard's yardstick (``gravac_lab.compare.scoreboard.yardstick``) is the static CF of the
ladder with the lowest median time to the bar *on the very seeds it is judged on*: a choice
made in hindsight. A search chooses online. This script asks what the same kind of choice
scores when it cannot see the seed it is judged on: for each setup and each seed ``s``, the
static CF fastest (median time to the bar) over the other seeds, among those that reached the
bar on all of them, is judged on ``s`` against the yardstick's time on ``s``::

    holdout ratio on s = seconds(CF chosen on the other seeds, s) / seconds(yardstick, s)

and the median over the seeds is printed beside the default search's ratio, per setup of each
stored scoreboard (``docs/studies/2026-12-05-holdout-yardstick.md``)::

    python scripts/holdout_yardstick.py docs/results/scoreboard*.json ...
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from gravac_lab.compare.scoreboard import Reach, Row, SetupScore, score


def _seconds(reaches: Sequence[Reach], seed: int) -> float:
    for r in reaches:
        if r.seed == seed:
            return math.inf if r.seconds is None else r.seconds
    raise ValueError(f"no run of seed {seed}")


def holdout_choice(statics: Sequence[Row], seed: int) -> Row | None:
    """The static row fastest (median time to the bar) over every seed but ``seed``, among
    those that reached the bar on all of them; ``None`` if none did. Ties go to the first."""
    best: tuple[float, Row] | None = None
    for row in statics:
        others = [r for r in row.reaches if r.seed != seed]
        if not others or any(r.seconds is None for r in others):
            continue
        median = statistics.median(r.seconds for r in others if r.seconds is not None)
        if best is None or median < best[0]:
            best = (median, row)
    return None if best is None else best[1]


def holdout_ratios(s: SetupScore) -> list[tuple[int, str, float]]:
    """Per seed: the seed, the static CF chosen on the other seeds and its ratio to the
    yardstick on this seed (``inf``: it did not reach the bar there)."""
    if s.yardstick is None:
        return []
    statics = [r for r in s.rows if r.kind == "static"]
    yard = s.row(s.yardstick)
    out = []
    for seed in (r.seed for r in yard.reaches):
        chosen = holdout_choice(statics, seed)
        if chosen is None:
            continue
        ratio = _seconds(chosen.reaches, seed) / _seconds(yard.reaches, seed)
        out.append((seed, chosen.label, ratio))
    return out


def _cell(values: Sequence[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"


def main(paths: Sequence[str]) -> None:
    print(
        "| scoreboard | setup | yardstick | chosen on the other seeds (per seed) "
        "| holdout ratio | default |"
    )
    print("|---|---|---|---|--:|--:|")
    for path in paths:
        for s in score(json.loads(Path(path).read_text())):
            rows = holdout_ratios(s)
            default = s.row("default").ratios if s.has("default") else None
            print(
                f"| {Path(path).name} | {s.setup} | {s.yardstick} | "
                f"{', '.join(label for _, label, _ in rows)} | "
                f"{_cell([r for _, _, r in rows])} | {_cell(list(default or []))} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
