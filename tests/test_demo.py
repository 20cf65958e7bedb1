"""``gravac demo``: the main job, end to end, sized for CI (2 gloo workers on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gravac import demo as demo_module
from gravac.cli import main
from gravac.demo import DemoConfig
from tests.background import Background, one_launch, succeeded

STEPS = 120
#: test accuracy the CI-sized run must reach (measured about 0.95 at 120 steps)
MIN_ACCURACY = 0.85


def _demo(log_dir: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``gravac demo --json``, CI-sized, logging to ``log_dir``, in a process of its own."""
    argv = ["--max-steps", str(STEPS), "--warmup-steps", "20", "--window", "10"]
    command = [sys.executable, "-m", "gravac", "demo", *argv, "--log-dir", str(log_dir), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done, log_dir


#: the module's one run (tests/background.py starts it with the session)
launches = one_launch("demo", _demo, "run")


@pytest.fixture(scope="module")
def demo(background: Background, request: pytest.FixtureRequest) -> tuple[dict[str, Any], Path]:
    """The demo's JSON summary and its log folder, once it has ended."""
    done, log_dir = succeeded(background, request, "demo")
    return json.loads(done.stdout), log_dir


@pytest.mark.slow
def test_demo_json_reaches_accuracy_and_saves_bytes(demo: tuple[dict[str, Any], Path]) -> None:
    summary, log_dir = demo
    assert summary["world_size"] == 2
    assert summary["final_accuracy"] >= MIN_ACCURACY
    assert len(summary["cf_trajectory"]) == STEPS
    # the warm-up's first step sends the top of the ladder, its second theta_min
    assert summary["cf_trajectory"][0] > summary["cf_trajectory"][1] == 10.0
    assert 0 < summary["wire_bytes"] < summary["dense_wire_bytes"] / 2
    assert Path(summary["plot"]).stat().st_size > 0
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert len(acc.Scalars("gravac/cf_sent")) == STEPS
    assert "demo/test_accuracy" in acc.Tags()["scalars"]


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before any worker starts: run in this process (tests/test_cli.py runs
    ``python -m gravac``)."""
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--max-steps", "0", "--json"])
    assert exc.value.code != 0
    assert "--max-steps must be an integer >= 1, got 0" in capsys.readouterr().err


def test_cuda_device_needs_a_gpu_per_worker() -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has two GPUs")
    with pytest.raises(ValueError, match="--device cuda needs one GPU per worker"):
        DemoConfig(device="cuda", workers=2)
    with pytest.raises(ValueError, match="--device must be one of"):
        DemoConfig(device="tpu")


def test_the_digits_are_read_from_scikit_learns_file_as_load_digits_gives_them() -> None:
    """The file is read without importing scikit-learn (a second of CPU per process), and its
    arrays are ``load_digits``' to the bit: its pixels, labels and their dtypes."""
    from sklearn.datasets import load_digits

    read = demo_module.digits_file_arrays()
    assert read is not None, "scikit-learn ships the digits' file"
    digits = load_digits()
    for ours, theirs in zip(read, (digits.data, digits.target), strict=True):
        assert ours.dtype == theirs.dtype
        assert np.array_equal(ours, theirs)


def test_without_the_file_the_digits_come_from_load_digits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scikit-learn that keeps no such file (or moved it) still gives the same split."""
    expected = demo_module.digits_data()
    monkeypatch.setattr(demo_module, "DIGITS_FILE", ("datasets", "data", "no-such-file.csv.gz"))
    assert demo_module.digits_file_arrays() is None
    for ours, theirs in zip(demo_module.digits_data(), expected, strict=True):
        assert torch.equal(ours, theirs)
