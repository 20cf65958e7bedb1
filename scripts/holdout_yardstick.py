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
import sys
from collections.abc import Sequence
from pathlib import Path

from gravac_lab.compare.scoreboard import Row, SetupScore, ratios, score, spread, yardstick


def holdout_choice(statics: Sequence[Row], seed: int) -> Row | None:
    """The static row the scoreboard's yardstick rule picks on every seed but ``seed``
    (:func:`gravac_lab.compare.scoreboard.yardstick`: the lowest median time to the bar among
    those that reached it on all of them, ties to the first); ``None`` if none did."""
    label = yardstick({row.label: [r for r in row.reaches if r.seed != seed] for row in statics})
    return next((row for row in statics if row.label == label), None)


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
        (ratio,) = ratios([r for r in chosen.reaches if r.seed == seed], yard.reaches)
        out.append((seed, chosen.label, ratio))
    return out


def _cell(values: Sequence[float]) -> str:
    if not values:
        return "-"
    med, low, high = spread(values)
    return f"{med:.2f} ({low:.2f}-{high:.2f})"


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
