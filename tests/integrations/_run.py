"""Running an integration example on 2 processes and reading each rank's report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: seconds one example run may take (2 processes importing the framework, a few steps)
RUN_TIMEOUT = 300
#: steps each test trains: past the warm-up (40) into the CF search
STEPS = 50


def run_example(command: list[str], report: Path) -> list[dict[str, Any]]:
    """Run ``command`` (which writes ``report/rank{R}.json``) and return the ranks' reports."""
    out = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "test accuracy" in out.stdout and "wire bytes" in out.stdout, out.stdout
    return [json.loads((report / f"rank{r}.json").read_text()) for r in range(2)]


def assert_compressed(reports: list[dict[str, Any]]) -> None:
    """Every rank took every step through gravac's hook, sent fewer bytes than dense fp32,
    and ends with the same parameters."""
    for r in reports:
        assert r["world_size"] == 2
        assert r["steps"] == STEPS
        assert 0 < r["wire_bytes"] < r["dense_wire_bytes"]
        assert r["cf_sent"] > 1  # compressed at the last step
    assert reports[0]["digest"] == reports[1]["digest"]
    assert reports[0]["accuracy"] == reports[1]["accuracy"]
