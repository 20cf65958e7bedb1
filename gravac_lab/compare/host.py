"""The runner's handle on a rank's fork server (:mod:`gravac_lab.compare.forkserver`).

A :class:`Host` starts the server (inside the rank's namespace: the runner wraps its command
line), hands it each job's worker arguments, reads its reports (one JSON line each: the worker's
pid, then its exit status) without blocking past a deadline, kills a worker still running when a
job ends early, and ends the server when the run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["SERVER_MODULE", "Host", "HostError", "server_argv"]

#: the fork server's entry point (``python -m``)
SERVER_MODULE = "gravac_lab.compare.forkserver"
#: bytes read from a server's reports at once
_READ_BYTES = 4096
#: seconds a server has to report a killed worker's end, or to end once its input is closed
_END_SECONDS = 10.0


class HostError(RuntimeError):
    """A rank's fork server ended."""


def server_argv(python: str) -> list[str]:
    """The fork server's command line, run by ``python``, for this process as its runner."""
    return [python, "-m", SERVER_MODULE, "--parent", str(os.getpid())]


class Host:
    """Worker ``rank``'s fork server, started with ``argv`` (:func:`server_argv`, wrapped in the
    rank's namespace) and ``env``; it runs one worker at a time."""

    def __init__(self, rank: int, argv: list[str], env: Mapping[str, str]) -> None:
        self.rank = rank
        self._proc = subprocess.Popen(
            argv, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._requests, self._reports = self._proc.stdin, self._proc.stdout
        self._buffer = b""
        #: the worker running now, ``None`` between jobs
        self.pid: int | None = None
        #: whether the server was asked for a worker whose pid it has not reported yet
        self._starting = False

    def _ended(self) -> HostError:
        """The error of a server that ended (its status once it has)."""
        return HostError(f"worker {self.rank}'s fork server ended with status {self._proc.wait()}")

    def _line(self, timeout: float) -> dict[str, Any] | None:
        """The server's next report, waiting up to ``timeout`` seconds (``None``: none yet).

        Raises:
            HostError: the server ended.
        """
        fd = self._reports.fileno()
        end = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
                return None
            chunk = os.read(fd, _READ_BYTES)
            if not chunk:
                raise self._ended()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        report: dict[str, Any] = json.loads(line)
        return report

    def start(self, argv: list[str], deadline: float) -> bool:
        """Start a worker with ``argv`` (:func:`gravac_lab.compare.worker.main`'s); whether it
        started by ``deadline`` (:func:`time.monotonic`).

        Raises:
            HostError: the server ended.
        """
        try:
            self._requests.write((json.dumps(argv) + "\n").encode())
            self._requests.flush()
        except BrokenPipeError:
            raise self._ended() from None
        self._starting = True
        report = self._line(deadline - time.monotonic())
        if report is None:
            return False
        self.pid, self._starting = report["pid"], False
        return True

    def poll(self, timeout: float = 0.0) -> int | None:
        """The running worker's exit status once it has ended (as
        :attr:`subprocess.Popen.returncode`), waiting up to ``timeout`` seconds; else ``None``.

        Raises:
            HostError: the server ended.
        """
        report = self._line(timeout)
        if report is None:
            return None
        self.pid = None
        status: int = report["status"]
        return status

    def stop_worker(self) -> None:
        """Kill the running worker, if any, and take its report (the server can start the next)."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        try:
            self.poll(_END_SECONDS)
        except HostError:
            self.pid = None

    def close(self) -> None:
        """Kill the running worker, end the server and wait for it. A server still starting a
        worker (its pid not reported) is killed, and the worker with it (``PR_SET_PDEATHSIG``):
        it would wait for its job's other ranks until ``--timeout``."""
        self.stop_worker()
        with contextlib.suppress(BrokenPipeError):
            self._requests.close()
        if self._starting:
            self._proc.kill()
        try:
            self._proc.wait(_END_SECONDS)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reports.close()
