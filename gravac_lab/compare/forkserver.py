"""``python -m gravac_lab.compare.forkserver``: a rank's workers of every job of a compare run.

A worker of a job (:mod:`gravac_lab.compare.worker`) started as a fresh interpreter spends
about 2.3 s of CPU importing torch, gravac and the training code before its first step, and a
twelve-seed study of three variants on 4 workers starts 144 of them. So the runner
(:mod:`gravac_lab.compare.runner`) starts one fork server per rank for the whole run, inside the
rank's network namespace and with the rank's environment (its handle:
:class:`gravac_lab.compare.host.Host`); the server imports the worker's modules once and forks
each job's worker from that state. Every job's workers still start fresh and alike: nothing of
an earlier job is in them, and none ran a torch operation before its job. The server runs no
torch operation and starts no thread itself (the one thread beside it is numpy's OpenBLAS pool,
which OpenBLAS winds down around a fork), so forking it is as safe as forking a data loader's
worker after ``import torch``.

The protocol, one JSON line each way: the runner writes the worker's arguments (a list of
strings, :func:`gravac_lab.compare.worker.main`'s ``argv``); the server forks the worker, writes
``{"pid": pid}``, waits for it and writes ``{"pid": pid, "status": s}`` (the exit status as
:attr:`subprocess.Popen.returncode` gives it: negative for a signal). At the end of its input it
exits. A worker's stdout goes to stderr (the server's stdout carries the protocol), its stdin is
``/dev/null``, and it is killed if its server dies, as the server is if the runner dies
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import TextIO

from gravac_lab.compare import worker

__all__ = ["main", "serve"]

#: Linux's prctl option: the signal a process receives when its parent dies
_PR_SET_PDEATHSIG = 1
#: the exit status of a worker whose job raised past :func:`gravac_lab.compare.worker.main`,
#: and of a server or worker whose parent had ended before it could ask to end with it
_FAILED = 1


def _die_with(parent: int) -> bool:
    """Ask for SIGKILL when the parent ends (``PR_SET_PDEATHSIG``); whether the parent is still
    ``parent`` (one that ended before the request leaves the process another parent)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == parent


def _run_worker(argv: list[str], server: int) -> None:
    """In the child forked by ``server`` (its pid): run the worker and exit with its status,
    never returning; at once if the server has ended (:func:`_die_with`)."""
    status = _FAILED
    try:
        if not _die_with(server):
            return
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)
        status = worker.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _send(out: TextIO, message: dict[str, int]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(requests: TextIO, out: TextIO) -> None:
    """Fork a worker for each line of ``requests`` and report on ``out``, until the input ends."""
    server = os.getpid()
    for line in requests:
        argv = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_worker(argv, server)
        _send(out, {"pid": pid})
        _, wait_status = os.waitpid(pid, 0)
        _send(out, {"pid": pid, "status": os.waitstatus_to_exitcode(wait_status)})


def main(argv: Sequence[str] | None = None) -> int:
    """Serve on stdin and stdout for the runner whose pid is ``--parent``: 0 at the end of the
    input; killed when the runner ends (a runner killed outright cannot end its servers), and
    its worker with it; 1 at once where the runner has already ended."""
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("--parent", type=int, required=True, help="the runner's pid")
    args = parser.parse_args(argv)
    if not _die_with(args.parent):
        return _FAILED
    serve(sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
