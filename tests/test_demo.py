"""``gravac demo``: the main job, end to end, sized for CI (2 gloo workers on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gravac.cli import main
from gravac.demo import DemoConfig

STEPS = 120
#: test accuracy the CI-sized run must reach (measured about 0.95 at 120 steps)
MIN_ACCURACY = 0.85


@pytest.mark.slow
def test_demo_json_reaches_accuracy_and_saves_bytes(tmp_path: Path) -> None:
    log_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gravac",
            "demo",
            "--max-steps",
            str(STEPS),
            "--warmup-steps",
            "20",
            "--window",
            "10",
            "--log-dir",
            str(log_dir),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    summary = json.loads(out.stdout)
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
