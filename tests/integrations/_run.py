"""Running the integration examples on 2 processes and reading each rank's report.

Both examples' runs are made once, side by side, by the package fixture ``example_runs``
(``tests/integrations/conftest.py``): each spends much of its run in one process (importing
the framework, a launcher waiting), so the two together keep the machine's cores busy.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: seconds one example run may take (2 processes importing the framework, a few steps)
RUN_TIMEOUT = 300
#: steps each test trains: past the warm-up (40) into the CF search
STEPS = 50

#: a run's command, made when it starts (a torchrun port is picked then, not before)
Command = Callable[[], list[str]]
Run = tuple[subprocess.CompletedProcess[str], Path]


def run_examples(commands: dict[str, tuple[Command, Path, dict[str, str]]]) -> dict[str, Run]:
    """Run every ``name: (command, report, env)`` at once (``env`` added to this process's);
    each run's output and report directory. Never raises on a failed run."""

    def run(command: Command, report: Path, env: dict[str, str]) -> Run:
        out = subprocess.run(
            command(),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            env={**os.environ, **env},
        )
        return out, report

    with ThreadPoolExecutor(max(1, len(commands))) as pool:
        futures = {name: pool.submit(run, *spec) for name, spec in commands.items()}
        return {name: f.result() for name, f in futures.items()}


def read_reports(run: Run) -> list[dict[str, Any]]:
    """The ranks' reports of a run (which writes ``report/rank{R}.json``), once it succeeded."""
    out, report = run
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
