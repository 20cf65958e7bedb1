"""``scripts/holdout_yardstick.py``: a static CF chosen on the other seeds, judged on each."""

from __future__ import annotations

import math
from types import ModuleType

from gravac_lab.compare.scoreboard import Reach, Row, SetupScore
from tests.helpers import load_script


def _script() -> ModuleType:
    return load_script("holdout_yardstick")


def _row(label: str, seconds: list[float | None]) -> Row:
    reaches = tuple(
        Reach(seed, s, None if s is None else 10, None, 0.0) for seed, s in enumerate(seconds)
    )
    return Row(label, "static", reaches, None)


def _setup(rows: list[Row], yardstick: str) -> SetupScore:
    return SetupScore("w@l", "accuracy", True, 0.9, yardstick, "loopback", tuple(rows))


def test_each_seed_is_judged_by_the_cf_fastest_on_the_others() -> None:
    script = _script()
    a = _row("cf10", [10.0, 10.0, 10.0])
    b = _row("cf20", [4.0, 12.0, 14.0])  # fastest on seed 0 alone
    c = _row("cf40", [30.0, 9.0, 8.0])  # fastest on seeds 1 and 2, the yardstick's median
    got = script.holdout_ratios(_setup([a, b, c], "cf10"))
    # seed 0: chosen on seeds 1, 2 -> cf40 (median 8.5); 30 / 10
    # seed 1: chosen on seeds 0, 2 -> cf20 (median 9, cf10 10, cf40 19); 12 / 10
    # seed 2: chosen on seeds 0, 1 -> cf20 (8.0); 14 / 10
    assert got == [(0, "cf40", 3.0), (1, "cf20", 1.2), (2, "cf20", 1.4)]


def test_a_cf_that_missed_the_bar_on_another_seed_is_not_chosen() -> None:
    script = _script()
    a = _row("cf10", [10.0, 10.0, 10.0])
    b = _row("cf20", [1.0, None, 1.0])  # fast, but missed seed 1
    got = dict(
        (seed, (label, r)) for seed, label, r in script.holdout_ratios(_setup([a, b], "cf10"))
    )
    assert got[1] == ("cf20", math.inf)  # chosen on seeds 0 and 2, it misses seed 1
    assert got[0] == ("cf10", 1.0)  # on seeds 1 and 2 only cf10 reached the bar on both
