"""``scripts/node_stage_probe.py``: gravac's shared-memory node stage against its collectives,
checked equal by the script, and no file left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gravac.launch import free_port

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "node_stage_probe.py"


def test_the_probe_checks_the_shared_sum_against_gloo_and_cleans_up() -> None:
    before = set(Path("/dev/shm").glob("gravac-node-*"))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--nodes", "2", "--numel", "1001", "--repeats", "2",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("median") == 2
    assert "collective: median" in run.stdout and "shm: median" in run.stdout
    assert set(Path("/dev/shm").glob("gravac-node-*")) == before
