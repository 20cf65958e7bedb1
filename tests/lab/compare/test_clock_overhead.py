"""``scripts/clock_overhead.py``: a run's clock over its steps times its median step, by role."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import load_script
from tests.lab.compare.scoreboard_made_up import made_run, study


def test_a_first_step_s_one_off_cost_shows_above_one(tmp_path: Path) -> None:
    ahead = made_run("cf10", 0, [0.5, 0.9], step_seconds=0.1)
    ahead["evaluations"] = [(10, 1.3, 0.5), (20, 2.3, 0.9)]  # 0.3 s once, then 0.1 s a step
    even = made_run("default", 0, [0.5, 0.9], step_seconds=0.2)
    timing = made_run("cf10", 0, [0.5], step_seconds=9.0)
    studies = [
        study("ladder", "vgg-digits", None, [ahead]),
        study("timing", "vgg-digits", "1gbit", [timing]),  # not read: no clock of its own
        study("searches", "vgg-digits", "1gbit", [even]),
    ]
    script = load_script("clock_overhead")
    got = script.overheads(studies)
    assert got == {"ladder": [pytest.approx(2.3 / 2.0)], "searches": [pytest.approx(1.0)]}
    path = tmp_path / "board.json"
    path.write_text(json.dumps({"studies": studies}))
    assert script.report([str(path), str(path)]) == [
        "ladder: 2 runs, clock / (steps x median step): median 1.150, range 1.150-1.150",
        "searches: 2 runs, clock / (steps x median step): median 1.000, range 1.000-1.000",
    ]
