"""``scripts/judged_progress.py``: the search's judged gains beside the static CFs' progress."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gravac_lab.compare.scoreboard import Reach
from tests.helpers import load_script


def _script() -> ModuleType:
    return load_script("judged_progress")


def _tables(steps: int, judged: dict[int, dict[str, list[float]]]) -> list[Any]:
    """``judged_by_step`` of a run of ``steps`` steps with ``judged``'s tables at their steps."""
    return [judged.get(step) for step in range(steps)]


def test_the_judged_gain_of_a_cf_is_its_median_over_the_decisions_after_the_warm_up() -> None:
    script = _script()
    first = {
        "judged_by_step": _tables(
            40,
            {
                10: {"10": [0.1, 5.0]},  # the warm-up's table: not counted
                11: {"10": [0.9, 5.0], "160": [math.nan, 7.0]},  # 160 not judged yet
                36: {"10": [0.8, 5.0], "160": [0.5, 7.0]},
            },
        )
    }
    second = {"judged_by_step": _tables(20, {12: {"10": [0.7, 5.0], "160": [0.6, 7.0]}})}
    got = script.judged_gains([first, second], 40)
    assert got == {10.0: pytest.approx(0.8), 160.0: pytest.approx(0.55)}
    # the decisions before step 20 alone: the second run's at 12, the first's at 11
    assert script.judged_gains([first, second], 20) == {
        10.0: pytest.approx(0.8),
        160.0: pytest.approx(0.6),
    }


def test_the_table_sets_each_cfs_progress_beside_its_judged_gain() -> None:
    script = _script()

    def reaches(*steps: int | None) -> list[Reach]:
        return [
            Reach(seed, None if s is None else 1.0, s, None, 0.0) for seed, s in enumerate(steps)
        ]

    statics = {10.0: reaches(100, 120, 110), 160.0: reaches(200, None, 220)}
    # judged before step 110 (cf10's steps) only: the table at step 200 does not count
    tables = {50: {"10": [0.99, 1.0], "160": [0.66, 1.0]}, 200: {"10": [0.5, 1.0]}}
    lines = script.table("w@l", statics, [{"judged_by_step": _tables(300, tables)}], 600)
    assert lines[0] == "### w@l"
    # cf160: median of 200, 600 (missed: the last step) and 220 is 220; 110 / 220 = 0.5
    assert "| cf10 | 110 | 1.00 | 0.990 | 1.00 |" in lines
    assert "| cf160 | 220 | 0.50 | 0.660 | 0.67 |" in lines


def _run(variant: str, seed: int, metrics: list[float]) -> dict[str, Any]:
    evaluations = [[10 * (i + 1), float(i + 1), m] for i, m in enumerate(metrics)]
    return {
        "variant": variant,
        "seed": seed,
        "evaluations": evaluations,
        "final_metric": metrics[-1],
        "wire_bytes_by_step": [0] * (10 * len(metrics)),
        "judged_by_step": _tables(10 * len(metrics), {12: {"40": [0.9, 1.0]}}),
    }


def test_a_study_is_read_against_the_bar_given() -> None:
    script = _script()
    study = {
        "workload": {"name": "vgg-digits"},
        "config": {"steps": 50},
        "runs": [
            _run("cf40", 0, [0.5, 0.97, 0.98, 0.98, 0.99]),  # held from step 20
            _run("cf40", 1, [0.97, 0.98, 0.5, 0.98, 0.99]),  # from step 10
            _run("default", 0, [0.5, 0.5, 0.5, 0.5, 0.5]),
        ],
    }
    lines = script.report(study, "default", 0.97)
    assert lines[0] == "### vgg-digits, 1 seeds"
    assert "| cf40 | 15 | 1.00 | 0.900 | 1.00 |" in lines
    with pytest.raises(ValueError, match="--bar is needed"):
        script.report(study, "default")


def test_the_static_cfs_of_another_study_join_a_search_trained_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    config, workload = {"steps": 50}, {"name": "vgg-digits"}
    statics = {"workload": workload, "config": config, "runs": [_run("cf40", 0, [0.5, 0.97, 0.98])]}
    searches = {"workload": workload, "config": config, "runs": [_run("default", 0, [0.5, 0.5])]}
    (tmp_path / "statics.json").write_text(json.dumps(statics))
    (tmp_path / "searches.json").write_text(json.dumps(searches))
    args = [str(tmp_path / "searches.json"), "--bar", "0.97"]
    script.main([*args, "--statics", str(tmp_path / "statics.json")])
    assert "| cf40 | 20 | 1.00 | 0.900 | 1.00 |" in capsys.readouterr().out
    with pytest.raises(ValueError):  # no static CF to set the search against
        script.main(args)


def test_rejudged_counts_the_held_back_energy_by_the_aggregates_signal_share() -> None:
    script = _script()
    run = {
        "signal_by_step": [None, 0.6, None, 0.2],
        "judged_by_step": [
            {"10": [0.7, 1.0]},  # before any share: the gain itself, kept
            {"10": [0.7, 1.0]},  # share 0.6: 1 - 0.3 = 0.6 (1 - e), e = 0.5
            None,
            {"160": [0.85, 2.0]},  # the largest share is still 0.6: 1 - e = 0.25
        ],
    }
    assert script.aggregate_share(0.6, 1) == pytest.approx(0.6)
    assert script.aggregate_share(0.6, 4) == pytest.approx(2.4 / 2.8)
    assert script.rejudged(run, 1)["judged_by_step"] == run["judged_by_step"]
    tables = script.rejudged(run, 4)["judged_by_step"]
    assert tables[0] == {"10": [0.7, 1.0]}
    assert tables[1]["10"] == [pytest.approx(1 - 0.5 * 2.4 / 2.8), 1.0]
    assert tables[2] is None
    assert tables[3]["160"] == [pytest.approx(1 - 0.25 * 2.4 / 2.8), 2.0]
    # a share under the search's floor (MIN_SIGNAL_SHARE, 0.5) counts as the floor
    low = script.rejudged({"signal_by_step": [0.1], "judged_by_step": [{"10": [0.9, 1.0]}]}, 2)
    assert low["judged_by_step"][0]["10"][0] == pytest.approx(1 - 0.2 * (1 / 1.5))


def test_ranks_below_one_are_refused_naming_the_option_and_its_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        _script().main(["any.json", "--ranks", "0"])
    assert exc.value.code == 2
    assert "--ranks must be an integer >= 1, got 0" in capsys.readouterr().err
