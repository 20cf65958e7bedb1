"""``gravac bench step``: its fronts, their baselines, its errors and command line (no timing
assertions)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch.distributed as dist

from gravac.cli import main
from gravac_lab.bench import step


def test_each_gravac_front_is_judged_against_its_plain_counterpart() -> None:
    rows = step.bench_step(workload="tiny-digits", steps=2, warmup=1)
    assert [r.front for r in rows] == ["sgd", "optimizer", "ddp", "hook"]
    assert [r.baseline for r in rows] == ["sgd", "sgd", "ddp", "ddp"]
    by = {r.front: r for r in rows}
    for r in rows:
        assert r.seconds > 0.0
        assert r.baseline_seconds == by[r.baseline].seconds
        assert r.ratio == pytest.approx(r.seconds / by[r.baseline].seconds)
        assert r.extra == pytest.approx(r.ratio - 1.0)
    assert by["sgd"].ratio == 1.0 and by["ddp"].ratio == 1.0
    assert not dist.is_initialized()  # its own group is gone


def test_the_default_search_runs_and_the_table_says_what_was_sent() -> None:
    rows = step.bench_step(workload="tiny-digits", steps=1, warmup=1, policy="default")
    assert step.format_step_table(rows).count("the default search") == 1


def test_bad_arguments_and_an_initialised_group_are_refused() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        step.bench_step(workload="tiny-digits", policy="trial")
    for bad in ({"steps": 0}, {"warmup": 0}, {"workers": 0}):
        with pytest.raises(ValueError, match="steps, warmup and workers must be >= 1"):
            step.bench_step(workload="tiny-digits", **bad)
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            with pytest.raises(RuntimeError, match="one is initialised"):
                step.bench_step(workload="tiny-digits")
        finally:
            dist.destroy_process_group()


def test_the_command_prints_json_rows_and_names_a_bad_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "step", "--workload", "tiny-digits", "--steps", "1", "--warmup", "1"]
    assert main([*argv, "--cf", "20", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["front"] for r in rows] == ["sgd", "optimizer", "ddp", "hook"]
    assert {r["cf"] for r in rows} == {20.0}
    with pytest.raises(SystemExit):
        main([*argv, "--steps", "0"])
    assert "--steps must be an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.slow
def test_two_workers_share_the_device_and_rank_0_reports() -> None:
    rows = step.bench_step(workload="tiny-digits", steps=2, warmup=1, workers=2)
    assert [r.front for r in rows] == ["sgd", "optimizer", "ddp", "hook"]
    assert {r.workers for r in rows} == {2}
    assert [r.baseline for r in rows] == ["sgd", "ddp", "ddp", "ddp"]  # SGD alone sends nothing
    assert all(r.seconds > 0.0 for r in rows)
    assert "2 processes (rank 0's times) sharing" in step.format_step_table(rows)
    assert not dist.is_initialized()
