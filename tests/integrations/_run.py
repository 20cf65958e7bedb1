"""Running the integration examples on 2 processes, reading each rank's report, and comparing
two runs' states bit for bit."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tests.helpers import torchrun_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: seconds one example run may take (2 processes importing the framework, a few steps)
RUN_TIMEOUT = 300
#: steps each test trains: past the warm-up (40) into the CF search
STEPS = 50

#: a run's command, made when it starts (a torchrun port is picked then, not before)
Command = Callable[[], list[str]]
Run = tuple[subprocess.CompletedProcess[str], Path]


def run_example(command: Command, report: Path, env: dict[str, str]) -> Run:
    """Run ``command()`` (``env`` added to this process's); its output and ``report``, the
    directory it writes its ranks' reports to. Never raises on a failed run."""
    out = subprocess.run(
        command(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env={**torchrun_env(report), **env},
    )
    return out, report


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


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` hold the same values, tensors bit for bit (``where``: named on failure)."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_two_ranks_mean(loaded: dict[str, Any], saved: list[dict[str, Any]], steps: int) -> None:
    """A hook state ``loaded`` at ``steps`` holds, as its every residual, the mean of the two
    ``saved`` ranks' (float64 sum, halved, in float32)."""
    assert loaded["steps"] == steps
    assert loaded["residuals"].keys() == saved[0]["residuals"].keys()
    for k, e in loaded["residuals"].items():
        a, b = (s["residuals"][k] for s in saved)
        assert torch.equal(e, ((a.double() + b.double()) / 2).float()), k


def rank_report(global_step: int, steps: int, hook: Any, model: Any) -> dict[str, Any]:
    """What a rank of a resume script writes at the end of a run: the framework's step, the
    engine's, the hook state (``GravacHookState.state_dict``) and the parameters."""
    return {
        "global_step": global_step,
        "steps": steps,
        "hook": hook,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
