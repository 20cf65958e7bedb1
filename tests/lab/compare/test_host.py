"""A rank's fork server (``python -m gravac_lab.compare.forkserver``) through its handle
(:class:`gravac_lab.compare.host.Host`): it forks one worker a job, reports each worker's
status, goes on after a failed or killed one, and takes its workers with it when it ends. The
runs end to end (``test_quick.py``, ``test_study_run.py``, ``test_netns.py``) train through
fork servers as well."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gravac.launch import free_port
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.host import SERVER_MODULE, Host, HostError, server_argv
from tests.helpers import alive

pytestmark = pytest.mark.slow

#: seconds a worker is given to start (the host imports torch first) or to end once killed
START_SECONDS = 60.0
#: a runner in a process of its own: it has its server start a worker that waits for a second
#: rank (the worker's arguments in ``argv[1]``), prints the server's and the worker's pids and
#: waits to be killed
RUNNER = """
import json, os, sys, time
from gravac_lab.compare.host import Host, server_argv
host = Host(0, server_argv(sys.executable), os.environ)
assert host.start(json.loads(sys.argv[1]), time.monotonic() + 60)
print(host._proc.pid, host.pid, flush=True)
time.sleep(600)
"""


def _host() -> Host:
    return Host(0, server_argv(sys.executable), os.environ)


def _argv(tmp: Path, name: str, *, world_size: int = 1, timeout: float = 60.0) -> list[str]:
    """A worker's arguments: a job that fails at once (its data file is missing) on one rank,
    or, with ``world_size`` 2, one that waits for a second rank that never comes."""
    config = tmp / f"{name}.json"
    config.write_text(CompareConfig(workload="tiny-digits", timeout=timeout).to_json())
    return [
        "--config", str(config), "--data", str(tmp / "no-data.pt"), "--job", "no-such-mode",
        "--rank", "0", "--world-size", str(world_size),
        "--master", f"127.0.0.1:{free_port()}", "--result", str(tmp / f"{name}-result.json"),
    ]  # fmt: skip


def _wait_status(host: Host) -> int:
    deadline = time.monotonic() + START_SECONDS
    while (status := host.poll(0.1)) is None:
        assert time.monotonic() < deadline, "the worker did not end"
    return status


def test_a_server_forks_a_worker_a_job_and_serves_on_after_a_failed_and_a_killed_one(
    tmp_path: Path,
) -> None:
    host = _host()
    try:
        assert host.start(_argv(tmp_path, "failed"), time.monotonic() + START_SECONDS)
        first = host.pid
        assert first is not None and first != host._proc.pid
        assert _wait_status(host) == 1
        assert host.pid is None
        error = json.loads((tmp_path / "failed-result.json").read_text())
        assert error["ok"] is False and "no-data.pt" in error["error"]

        assert host.start(_argv(tmp_path, "waits", world_size=2), time.monotonic() + 60)
        waiting = host.pid
        assert waiting is not None and waiting != first
        assert host.poll(1.0) is None  # waits for rank 1
        host.stop_worker()
        assert host.pid is None and not alive(waiting)

        assert host.start(_argv(tmp_path, "again"), time.monotonic() + START_SECONDS)
        assert _wait_status(host) == 1
    finally:
        host.close()
    assert host._proc.returncode == 0


def test_a_server_that_dies_is_an_error_naming_its_rank_and_takes_its_worker_with_it(
    tmp_path: Path,
) -> None:
    host = _host()
    try:
        assert host.start(_argv(tmp_path, "waits", world_size=2), time.monotonic() + 60)
        waiting = host.pid
        assert waiting is not None
        os.kill(host._proc.pid, signal.SIGKILL)
        with pytest.raises(HostError, match=r"^worker 0's fork server ended with status -9$"):
            host.poll(START_SECONDS)
        deadline = time.monotonic() + START_SECONDS
        while alive(waiting):  # PR_SET_PDEATHSIG
            assert time.monotonic() < deadline, "the worker outlived its server"
            time.sleep(0.05)
        with pytest.raises(HostError, match=r"^worker 0's fork server ended with status -9$"):
            host.start(_argv(tmp_path, "after"), time.monotonic() + START_SECONDS)
    finally:
        host.close()


def test_a_worker_not_started_by_the_deadline_is_reported_and_its_server_killed(
    tmp_path: Path,
) -> None:
    """The server is still importing torch: nothing answers within 0.01 s. Closed then, it is
    killed, not waited for: the worker it would start would wait for its job's other ranks."""
    host = _host()
    try:
        assert host.start(_argv(tmp_path, "late", world_size=2), time.monotonic() + 0.01) is False
        assert host.pid is None
    finally:
        host.close()
    assert host._proc.returncode == -signal.SIGKILL


def test_a_runner_killed_outright_takes_its_server_and_the_worker_with_it(tmp_path: Path) -> None:
    argv = json.dumps(_argv(tmp_path, "waits", world_size=2))
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, argv], stdout=subprocess.PIPE, text=True
    )
    try:
        assert runner.stdout is not None
        server, worker = map(int, runner.stdout.readline().split())
        assert alive(server) and alive(worker)
        runner.kill()
        runner.wait()
        deadline = time.monotonic() + START_SECONDS
        while alive(server) or alive(worker):  # PR_SET_PDEATHSIG, twice
            assert time.monotonic() < deadline, "the server or its worker outlived the runner"
            time.sleep(0.05)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def test_a_server_whose_runner_is_not_its_parent_ends_at_once() -> None:
    """Its runner ended before the server asked to end with it: it serves no one."""
    done = subprocess.run(
        [sys.executable, "-m", SERVER_MODULE, "--parent", str(os.getpid() + 10**6)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=START_SECONDS,
    )
    assert done.returncode == 1
