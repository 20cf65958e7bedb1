"""``examples/torchrun_restarts.py`` under torchrun's own restarts (2 gloo processes on loopback).

Rank 1 is killed once at step :data:`FAIL_AT`; torchrun (``--max-restarts 1``) restarts both
workers, which join a new group (``gravac.launch.init_restartable_group``), resume from their
checkpoints and end with the parameters of a run that was never interrupted, bit for bit. The
two torchrun launches start with the session (``launches``, tests/background.py).
"""

from __future__ import annotations

import functools
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.background import Background
from tests.helpers import torchrun_env

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_restarts.py"
#: the step at which rank 1 is killed, once
FAIL_AT = 5
STEPS = 8

Run = tuple[Path, subprocess.CompletedProcess[str]]


def _torchrun(folder: Path, max_restarts: int, *args: str) -> Run:
    """The example on 2 processes, checkpointing into ``folder``; never raises on a failed run.
    ``--standalone`` picks the rendezvous port itself."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={max_restarts}",
        str(EXAMPLE),
        "--checkpoint-dir",
        str(folder),
        "--steps",
        str(STEPS),
        *args,
    ]
    env = torchrun_env(folder)
    return folder, subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Run]]:
    """The killed and restarted run, and the uninterrupted one."""
    return {
        "restarted": functools.partial(
            _torchrun, tmp / "restarted", 1, "--fail-at-step", str(FAIL_AT)
        ),
        "straight": functools.partial(_torchrun, tmp / "straight", 0),
    }


@pytest.fixture(scope="module")
def runs(background: Background, request: pytest.FixtureRequest) -> dict[str, Run]:
    return background.results(request)


@pytest.mark.slow
def test_a_killed_and_restarted_run_ends_as_an_uninterrupted_one(runs: dict[str, Run]) -> None:
    restarted, out = runs["restarted"]
    straight, ref = runs["straight"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert (restarted / "failed-once").exists()  # rank 1 was killed
    for rank in range(2):  # and both workers were restarted, and resumed
        assert f"rank {rank}: resumed after step {FAIL_AT - 1}" in out.stdout
        final = torch.load(restarted / f"final-rank{rank}.pt", weights_only=True)
        want = torch.load(straight / f"final-rank{rank}.pt", weights_only=True)
        assert len(final) == len(want) == 4
        for a, b in zip(final, want, strict=True):
            assert torch.equal(a, b)
    assert "resumed" not in ref.stdout


def test_a_failure_step_outside_the_run_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line is checked before the process group is joined: run in this process."""
    argv = [str(EXAMPLE), "--checkpoint-dir", "unused", "--steps", "4", "--fail-at-step", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert exc.value.code == 2
    assert "--fail-at-step must be in [0, --steps) = [0, 4), got 4" in capsys.readouterr().err
