"""A rank that fails mid-run, in real 2-rank gloo runs (``tests/faulty_peer.py``).

Rank 1 fails at the start of step :data:`tests.faulty_peer.FAULT_STEP`; the tests read how rank
0, which trains on, ends. Killed, its peer's collectives fail at once: rank 0 exits with status
1 and one readable gravac error naming the step and the collective (before, the error's text was
nested once per ``Future.then`` callback, and gloo could abort the exit with SIGABRT:
``gravac.comm`` says why). Stopped or asleep, rank 0 waits for it ``step_timeout`` seconds,
then raises :class:`gravac.StepTimeoutError` and exits, where it waited for the process group's
own timeout (30 minutes) before.

The four runs are started with the session (``launches``, tests/background.py), beside the
tests run in this process.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gravac.comm import BACKEND_MARGIN
from gravac.launch import free_port
from tests.background import Background
from tests.faulty_peer import FAULT_STEP

ROOT = Path(__file__).resolve().parents[1]
#: the step timeout of the runs whose peer stops or sleeps, seconds
STEP_TIMEOUT = 2.0
#: seconds rank 0 may take, past the step timeout and the backend's margin, to raise and exit
#: (interpreter shutdown on a loaded 2-core machine); without a timeout it would wait 30 minutes
EXIT_SLACK = 20.0
#: seconds a run may take in all (two processes importing torch, then the fault)
RUN_TIMEOUT = 180.0
#: the runs: (front end, rank 1's fault, step timeout or "none")
RUNS = {
    "optimizer-kill": ("optimizer", "kill", "none"),
    "ddp-kill": ("ddp", "kill", "none"),
    "optimizer-stop": ("optimizer", "stop", str(STEP_TIMEOUT)),
    "ddp-sleep": ("ddp", "sleep", str(STEP_TIMEOUT)),
}
#: how the error names the step and the collective
NAMED = re.compile(
    rf"gravac step {FAULT_STEP}: the (all-gather|all-reduce) of "
    r"(unit \d+'s (payload|gradient) \(\d+ tensors?, \d+ elements\)|the step's scalars)"
)


@dataclass(frozen=True)
class Survivor:
    """How rank 0 ended: its exit status, stderr, and the seconds from rank 1's fault to its
    exit."""

    returncode: int
    stderr: str
    seconds: float


def _run(tmp: Path, front: str, fault: str, timeout: str) -> Survivor:
    """Both ranks of ``tests/faulty_peer.py``; rank 1 is killed once rank 0 has ended. Never
    raises on a failed run (a rank 0 that outlives ``RUN_TIMEOUT`` is killed: status -9)."""
    tmp.mkdir(parents=True)
    fault_at = tmp / "fault_at"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "tests.faulty_peer", front, fault, timeout, str(fault_at)]
    ranks = []
    for rank in range(2):
        with open(tmp / f"rank{rank}.err", "w") as err:  # the process writes its own copy
            env["RANK"] = str(rank)
            ranks.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=err))
    survivor, peer = ranks
    try:
        survivor.wait(RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        survivor.kill()
        survivor.wait()
    ended = time.time()
    peer.kill()
    peer.wait()
    failed = float(fault_at.read_text()) if fault_at.exists() else ended
    stderr = (tmp / "rank0.err").read_text()
    return Survivor(survivor.returncode, stderr, ended - failed)


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Survivor]]:
    """Every run of the module (:data:`RUNS`), by name (started with the session)."""
    return {name: functools.partial(_run, tmp / name, *args) for name, args in RUNS.items()}


@pytest.fixture(scope="module")
def runs(background: Background, request: pytest.FixtureRequest) -> dict[str, Survivor]:
    """The module's runs (``launches``), once all have ended."""
    return background.results(request)


def _one_readable_error(stderr: str, kind: str) -> str:
    """The one gravac error line of ``stderr``, which must be of class ``kind``."""
    assert "terminate called" not in stderr, stderr[-3000:]
    assert "Got the following error when running the callback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "Error: gravac step" in line]
    assert len(lines) == 1, stderr[-3000:]
    assert f"{kind}: gravac step {FAULT_STEP}: " in lines[0]
    assert NAMED.search(lines[0]), lines[0]
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("front", ["optimizer", "ddp"])
def test_a_killed_peer_ends_the_survivor_with_status_1_and_one_named_error(
    runs: dict[str, Survivor], front: str
) -> None:
    run = runs[f"{front}-kill"]
    assert run.returncode == 1, run.stderr[-3000:]  # not -6 (SIGABRT)
    line = _one_readable_error(run.stderr, "CollectiveError")
    assert " failed: " in line  # then the process group's message, once
    assert run.seconds < EXIT_SLACK, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimizer-stop", "ddp-sleep"])
def test_a_stopped_or_sleeping_peer_raises_the_step_timeout_and_exits(
    runs: dict[str, Survivor], name: str
) -> None:
    run = runs[name]
    assert run.returncode == 1, run.stderr[-3000:]
    line = _one_readable_error(run.stderr, "StepTimeoutError")
    assert f"did not complete within step_timeout={STEP_TIMEOUT:g} s" in line
    assert STEP_TIMEOUT <= run.seconds < STEP_TIMEOUT + BACKEND_MARGIN + EXIT_SLACK, run
