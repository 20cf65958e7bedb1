"""A study end to end: 2 gravac variants x 2 seeds, real worker processes and gloo on loopback.

Every output is written (JSON, CSV, plots) and read back; every rank records the CF it sent
each step, and the runner compares them with rank 0's (``ranks_agree``).
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gravac.buckets import DEFAULT_BUCKET_BYTES
from gravac_lab.compare import plots
from tests.background import Background
from tests.helpers import run_compare

pytestmark = pytest.mark.slow

#: a static CF without error feedback in buckets of BUCKET_BYTES, and an adaptive policy;
#: 30 steps take the exponential search past its warm-up
BUCKET_BYTES = 4096
VARIANTS = (
    f'cf10=topk:fixed{{"cf": 10}}:{{"error_feedback": false, "bucket_bytes": {BUCKET_BYTES}}}',
    "topk:exponential",
)
LABELS = ["cf10", "topk-exponential"]
SEEDS = [0, 1]
STEPS = 30
#: a step decay of the learning rate: halved after steps 10 and 20
MILESTONES, GAMMA = (10, 20), 0.5
#: the CF range the gravac modes search (CompareConfig's defaults)
THETA_MIN, THETA_MAX = 10.0, 1000.0


def _study(tmp: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    argv = ["--quick", "--modes", "gravac", "--steps", str(STEPS),
            "--lr-milestones", ",".join(map(str, MILESTONES)), "--lr-gamma", str(GAMMA),
            "--seeds", ",".join(map(str, SEEDS)), "--out", str(tmp / "study.json"),
            "--csv", str(tmp / "runs.csv"), "--plots", str(tmp / "plots")]  # fmt: skip
    for variant in VARIANTS:
        argv += ["--variant", variant]
    return run_compare(*argv), tmp


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Any]]:
    """The module's one study (tests/background.py starts it with the session); none without
    matplotlib, which draws its plots."""
    if importlib.util.find_spec("matplotlib") is None:
        return {}
    return {"study": functools.partial(_study, tmp)}


@pytest.fixture(scope="module")
def study(
    background: Background, request: pytest.FixtureRequest
) -> tuple[dict[str, Any], Path, str]:
    pytest.importorskip("matplotlib")
    done, tmp = background.results(request)["study"]
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp / "study.json").read_text()), tmp, done.stdout


def test_every_variant_runs_once_per_seed(study: tuple[dict[str, Any], Path, str]) -> None:
    summary, _, _ = study
    assert summary["study"]["seeds"] == SEEDS
    assert [v["label"] for v in summary["study"]["variants"]] == LABELS
    runs = summary["runs"]
    assert [(r["mode"], r["variant"], r["seed"]) for r in runs] == [
        ("gravac", label, seed) for seed in SEEDS for label in LABELS
    ]
    lr = summary["config"]["lr"]
    for r in runs:
        assert r["steps"] == STEPS
        assert len(r["cf_sent_by_step"]) == len(r["wire_bytes_by_step"]) == STEPS
        # the schedule steps GravacOptimizer's own rate, as a user's scheduler would
        assert r["lr_by_step"] == pytest.approx(
            [lr] * MILESTONES[0]
            + [lr * GAMMA] * (MILESTONES[1] - MILESTONES[0])
            + [lr * GAMMA**2] * (STEPS - MILESTONES[1])
        )
    assert [(a["variant"], a["seeds"]) for a in summary["aggregates"]] == [
        (label, SEEDS) for label in LABELS
    ]


def test_the_cf_sent_is_the_variant_s_and_every_rank_sent_the_same(
    study: tuple[dict[str, Any], Path, str],
) -> None:
    summary, _, _ = study
    for r in summary["runs"]:
        assert r["ranks_agree"] is True, f"{r['variant']} seed {r['seed']}"
        if r["variant"] == "cf10":
            assert r["cf_sent_by_step"] == [10.0] * STEPS
            assert r["options"]["memory"] == "NoMemory"  # the variant's engine options
            assert r["options"]["bucket_bytes"] == BUCKET_BYTES
        else:
            assert all(THETA_MIN <= cf <= THETA_MAX for cf in r["cf_sent_by_step"])
            assert r["options"]["memory"] == "ResidualMemory"
            assert r["options"]["bucket_bytes"] == DEFAULT_BUCKET_BYTES
    assert all(a["ranks_agree"] is True for a in summary["aggregates"])


def test_seeds_train_differently(study: tuple[dict[str, Any], Path, str]) -> None:
    summary, _, _ = study
    for label in LABELS:
        seed0, seed1 = (r for r in summary["runs"] if r["variant"] == label)
        assert [e[2] for e in seed0["evaluations"]] != [e[2] for e in seed1["evaluations"]]


def test_csv_table_and_plots(study: tuple[dict[str, Any], Path, str]) -> None:
    summary, tmp, stdout = study
    with (tmp / "runs.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], int(r["seed"])) for r in rows] == [
        (label, seed) for seed in SEEDS for label in LABELS
    ]
    assert stdout.strip() == summary["table"]
    table_rows = [line for line in stdout.splitlines() if line.startswith("| gravac |")]
    assert [line.split(" | ")[1] for line in table_rows] == LABELS
    for name in plots.PLOT_FILES.values():
        assert (tmp / "plots" / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
