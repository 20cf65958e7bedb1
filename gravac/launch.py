"""Start N worker processes on this machine joined in a gloo process group over loopback.

Used by ``gravac demo`` and by the multi-process tests: every worker runs ``fn(rank, world_size,
*args)`` inside an initialised ``torch.distributed`` group and its return value is sent back.
Workers that fail or outlive ``timeout`` are killed, and the error names the rank.

Under torchrun, :func:`init_restartable_group` joins the group so that a worker group that
torchrun restarts (``--max-restarts``) can join it again.
"""

from __future__ import annotations

import gc
import io
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Container, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "init_restartable_group", "release_group", "spawn_workers"]

#: loopback only: workers never listen on another interface
_HOST = "127.0.0.1"
#: seconds a finished worker gets to exit after reporting
_EXIT_GRACE = 10.0
#: seconds between checks that every worker is still alive
_POLL_SECONDS = 0.5
#: torchrun's count of the worker group's restarts so far (absent or 0 in its first run)
_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def init_restartable_group(backend: str | None = None, *, timeout: timedelta | None = None) -> None:
    """``torch.distributed.init_process_group(backend)`` from the environment torchrun sets
    (``env://``), in store keys of this restart of the worker group only.

    torchrun (torch 2.13) points every worker at its agent's rendezvous store, one store for
    the whole job: the keys with which the first workers made their group are
    still there when ``--max-restarts`` starts new ones, which then read the old workers'
    addresses (gloo: "Connection refused" in ``connectFullMesh``) or wait on them (a hang),
    plain DDP as much as gravac. Here the group is made through a ``PrefixStore`` named
    after ``TORCHELASTIC_RESTART_COUNT``, so each restart has keys of its own. The count is
    each node's agent's, and an agent that restarts for a change of membership does not
    count it: on several nodes, start torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    instead (rank 0 then serves a new store in every round).

    Args:
        backend: as ``init_process_group``'s (``None``: torch's default for the devices).
        timeout: as ``init_process_group``'s, for the store too (``None``: the defaults).
    """
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    store, rank, world_size = next(dist.rendezvous("env://", **options))
    prefix = dist.PrefixStore(f"restart{os.environ.get(_RESTART_COUNT, '0')}", store)
    dist.init_process_group(
        backend, store=prefix, rank=rank, world_size=world_size, timeout=timeout
    )


def release_group(group: dist.ProcessGroup | None = None) -> None:
    """Get every rank ready to destroy ``group`` (``None``: the default group): free what
    still holds it, then wait for every rank. Call it on every rank before
    ``dist.destroy_process_group()``.

    DDP's reducer holds its process group, and a ``DistributedDataParallel`` module sits in a
    reference cycle: once deleted it is freed only by the garbage collector, at the latest
    during interpreter shutdown, after the group was destroyed, and gloo's threads then abort
    the exit ("terminate called without an active exception": 5 of 37 torchrun runs of
    ``examples/train_digits.py --ddp-hook`` before, 0 of 50 with it). And a
    rank that destroys its group while another still communicates can abort the other.
    """
    gc.collect()
    dist.barrier(group=group)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://{_HOST}:{port}", rank=rank, world_size=world_size
        )
        try:
            out = fn(rank, world_size, *args)
            # Free what still holds the group (DDP's reducer sits in a reference cycle), then
            # tear the group down together: see release_group.
            release_group()
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # tensors by value: shared-memory handles die with the worker
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _death(code: int | None) -> str:
    """How a worker that never reported ended, with the likely cause."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        cause = (
            " (the kernel's out-of-memory killer sends it: fewer workers, or more memory)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"was killed by {name}{cause}, without reporting"
    return (
        f"exited with code {code} without reporting (if the main module has no "
        "`if __name__ == '__main__':` guard, spawned workers cannot start)"
    )


def _first_dead(procs: list[Any], reported: Container[int]) -> str | None:
    """The first worker that ended without reporting, and how, or ``None``."""
    for rank, p in enumerate(procs):
        if rank not in reported and not p.is_alive():
            return f"worker {rank} of {len(procs)} {_death(p.exitcode)}"
    return None


def _check_alive(procs: list[Any], done: dict[int, Any], deadline: float, timeout: float) -> None:
    """Raise if a worker that has not reported is dead, or if time is up."""
    dead = _first_dead(procs, done)
    if dead is not None:
        raise RuntimeError(dead)
    if time.monotonic() > deadline:
        missing = len(procs) - len(done)
        raise TimeoutError(f"{missing} of {len(procs)} workers did not finish in {timeout} s")


def spawn_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; results in rank order.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes (>= 1).
        backend: the ``torch.distributed`` backend.
        timeout: seconds before every worker is killed and ``TimeoutError`` raised.
        threads: torch intra-op threads per worker (default: cores / world_size, at least 1).

    Raises:
        RuntimeError: a worker raised; the message holds its traceback.
        TimeoutError: the workers did not finish in time.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, threads, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                _check_alive(procs, out, deadline, timeout)
                continue
            if not ok:  # the root cause first: a peer's death fails the others' collectives
                dead = _first_dead(procs, {*out, rank})
                cause = f"{dead}; then " if dead is not None else ""
                raise RuntimeError(f"{cause}worker {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(_EXIT_GRACE)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
