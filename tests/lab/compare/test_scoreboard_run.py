"""``gravac compare --scoreboard`` end to end on tiny-digits on loopback: real workers and gloo,
a 2-CF ladder and its twins, one search, one seed, a few steps; then its table rebuilt from the
JSON."""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gravac_lab.compare.results_page import PLOTS
from gravac_lab.compare.scoreboard import HOLD, TWIN_BATCHES, bar, bar_evaluation
from tests.background import Background
from tests.helpers import run_compare

pytestmark = pytest.mark.slow

#: dense's step budget; the ladder and the search train twice as many
STEPS = 20
EVAL_EVERY = 5
LADDER = "10,100"
SEARCH = "default=topk:exponential"


def _scoreboard(out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    done = run_compare(
        "--scoreboard", "--setups", "tiny-digits@loopback", "--ladder", LADDER,
        "--variant", SEARCH, "--seeds", "0", "--steps", str(STEPS),
        "--eval-every", str(EVAL_EVERY), "--twins", "--out", str(out),
    )  # fmt: skip
    return done, out


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Any]]:
    """The module's one scoreboard (tests/background.py starts it with the session)."""
    return {"scoreboard": functools.partial(_scoreboard, tmp / "scoreboard.json")}


@pytest.fixture(scope="module")
def scoreboard(
    background: Background, request: pytest.FixtureRequest
) -> tuple[dict[str, Any], str, Path]:
    done, out = background.results(request)["scoreboard"]
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout, out


def test_it_trains_dense_the_ladder_and_the_search_on_loopback(
    scoreboard: tuple[dict[str, Any], str, Path],
) -> None:
    stored, _, _ = scoreboard
    studies = stored["studies"]
    assert [(s["role"], s["workload"], s["link"]) for s in studies] == [
        ("dense", "tiny-digits", None),
        ("ladder", "tiny-digits", None),
        ("searches", "tiny-digits", None),
        ("twins", "tiny-digits", None),
    ]
    dense, ladder, searches, twins = (s["summary"]["runs"] for s in studies)
    assert [(r["mode"], r["steps"]) for r in dense] == [("ddp", STEPS)]
    # the ladder and the search trained in one study, stored as two
    for study, labels in ((studies[1], ["cf10", "cf100"]), (studies[2], ["default"])):
        summary = study["summary"]
        assert [r["variant"] for r in summary["runs"]] == labels
        assert [a["variant"] for a in summary["aggregates"]] == labels
        assert [v["label"] for v in summary["study"]["variants"]] == labels
    assert stored["scoreboard"]["interleaved"] is True
    assert stored["scoreboard"]["ladder"] == [10.0, 100.0]
    header = stored["scoreboard"]
    assert header["command"].startswith("gravac compare --scoreboard --setups tiny-digits@loopback")
    assert header["commit"] is not None  # the tests run from a checkout
    # the compressed runs train twice dense's budget, or stop once they hold dense's bar
    bar_value = bar([r["final_metric"] for r in dense], higher_is_better=True)
    for study in studies[1:]:
        assert study["summary"]["config"]["stop_at"] == bar_value
    for run in [*ladder, *twins, *searches]:
        metrics = [e[2] for e in run["evaluations"]]
        held = bar_evaluation(metrics, bar_value, higher_is_better=True)
        if held is None:
            assert run["steps"] == 2 * STEPS, run["variant"]
        else:  # stopped at the evaluation that confirmed the bar: the last one
            assert held + HOLD == len(metrics), run["variant"]
            assert run["steps"] == run["evaluations"][-1][0] <= 2 * STEPS
    assert any(r["steps"] < 2 * STEPS for r in [*ladder, *searches])  # one did stop


def test_the_twins_train_the_ladder_again_on_other_batches(
    scoreboard: tuple[dict[str, Any], str, Path],
) -> None:
    stored, stdout, _ = scoreboard
    _, ladder, _, twins = (s["summary"] for s in stored["studies"])
    assert (ladder["config"]["batches"], twins["config"]["batches"]) == (0, TWIN_BATCHES)
    assert [r["variant"] for r in twins["runs"]] == [r["variant"] for r in ladder["runs"]]
    for own, twin in zip(ladder["runs"], twins["runs"], strict=True):
        # the same CF and seed, other batches: another trajectory
        assert own["evaluations"] != twin["evaluations"], own["variant"]
    assert "- twins: every static CF trained again on loopback" in stdout
    assert "on loopback in the ladder's study, each seed's after its static CFs" in stdout
    assert "| cf10 twin | twin |" in stdout and "| cf100 twin | twin |" in stdout
    assert "| setup | yardstick | its twin: ratio |" in stdout


def test_it_prints_the_table_and_rebuilds_it_from_the_json_without_training(
    scoreboard: tuple[dict[str, Any], str, Path],
) -> None:
    stored, stdout, out = scoreboard
    assert stdout.strip() == stored["table"]
    assert "| tiny-digits@loopback | test accuracy >= " in stdout
    assert f"- made by: `{stored['scoreboard']['command']}` (commit " in stdout
    for row in (
        "| ddp | dense |",
        "| cf10 | static |",
        "| cf100 | static |",
        "| default | search |",
    ):
        assert row in stdout
    rebuilt = run_compare("--scoreboard", "--from-json", str(out))
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    assert rebuilt.stdout == stdout
    assert "gravac compare:" not in rebuilt.stderr  # no study ran


def test_the_results_page_from_the_json(
    scoreboard: tuple[dict[str, Any], str, Path], tmp_path: Path
) -> None:
    _, _, out = scoreboard
    page = tmp_path / "RESULTS.md"
    done = run_compare("--scoreboard", "--from-json", str(out), "--report", str(page))
    assert done.returncode == 0, done.stderr[-2000:]
    text = page.read_text()
    assert "| tiny-digits@loopback, 2 workers | test accuracy >= " in text
    assert "Trained by `gravac compare --scoreboard --setups tiny-digits@loopback" in text
    figures = tmp_path / PLOTS / "tiny-digits-loopback-2w"
    assert sorted(p.name for p in figures.iterdir()) == [
        "cf_density.png", "cf_steps.png", "metric_bytes.png", "metric_time.png",
    ]  # fmt: skip
