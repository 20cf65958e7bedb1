"""Spawned gloo groups that run many multi-process scenarios, one spawn for all of them.

``gravac.launch.spawn_workers`` starts ``world_size`` fresh processes for every call: each
imports torch and builds a gloo group, seconds of work per call. A :class:`WorkerPool` starts
them once and then runs scenarios sent to it: ``pool.run(fn, *args)`` calls
``fn(rank, world_size, *args)`` on every rank inside the pool's initialised group and returns
the results in rank order, like ``spawn_workers``.

A scenario builds its own model and optimizer (nothing is kept between scenarios but the
group), and after it every rank frees what still holds the group and meets at a barrier
(``gravac.launch.release_group``), so the next scenario starts on a clean group. A scenario
that raises on one rank, a rank that dies, or a run past its timeout tears the whole pool down
(a rank may be stuck in a collective its peer never joins) and raises; :class:`Workers` starts
a fresh pool at the next run. A scenario may destroy the group and build another one of the
same size (the tests of a group joined late do): the pool keeps it; one that leaves no group
of the pool's size ends the pool after its results are read.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gravac.launch import free_port, release_group

#: seconds a pool may take to start (world_size processes importing torch, the gloo group)
START_TIMEOUT = 180.0
#: seconds between checks that every rank is still alive
_POLL_SECONDS = 0.5
#: seconds a rank gets to exit once told to
_EXIT_GRACE = 10.0


def _serve(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    tasks: Any,
    results: Any,
    parent: int,
) -> None:
    """A rank of the pool: join the group, then run every scenario sent until told to stop."""
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", b""))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned: the test session is gone
                return
            continue
        if task is None:
            break
        try:
            fn, args = torch.load(io.BytesIO(task), weights_only=False)
            out = fn(rank, world_size, *args)
            torch.set_num_threads(threads)  # as the next scenario expects it
            buf = io.BytesIO()
            torch.save(out, buf)  # tensors by value: shared-memory handles die with the rank
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
            return  # the pool is torn down: a peer may be waiting in a collective
        kept = dist.is_initialized() and dist.get_world_size() == world_size
        if kept:
            release_group()  # DDP's reducer sits in a reference cycle; every rank done
        results.put((rank, "ok" if kept else "left", buf.getvalue()))
        if not kept:
            return
    release_group()
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned processes joined in one gloo group over loopback."""

    def __init__(self, world_size: int, threads: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self.scenarios = 0
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, port, self.threads, q, self._results, os.getpid()),
                name=f"gloo-pool-{world_size}-rank-{r}",
            )
            for r, q in enumerate(self._tasks)
        ]
        for p in self._procs:
            p.start()
        try:
            self._collect("ready", START_TIMEOUT)
        except BaseException:
            self.close(kill=True)
            raise

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order.

        Raises:
            RuntimeError: a rank raised (the message holds its traceback) or died; the pool is
                closed.
            TimeoutError: the ranks did not finish in ``timeout`` s; the pool is closed.
        """
        if not self.alive:
            raise RuntimeError("the pool is closed")
        buf = io.BytesIO()
        torch.save((fn, args), buf)  # fails here, not in the ranks, if it does not pickle
        task = buf.getvalue()
        for q in self._tasks:
            q.put(task)
        self.scenarios += 1
        try:
            out = self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)
        except BaseException:
            self.close(kill=True)
            raise
        kinds = {kind for kind, _ in out}
        if kinds != {"ok"}:  # the scenario left the pool's group: the ranks have returned
            self.close()
        return [torch.load(io.BytesIO(value), weights_only=False) for _, value in out]

    def _collect(self, what: str, timeout: float) -> list[tuple[str, bytes]]:
        """One message from every rank, in rank order."""
        got: dict[int, tuple[str, bytes]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            try:
                rank, kind, value = self._results.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                for rank, p in enumerate(self._procs):
                    if rank not in got and not p.is_alive():
                        raise RuntimeError(
                            f"{what}: rank {rank} of the pool exited with code {p.exitcode} "
                            "without reporting"
                        ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(got))
                    raise TimeoutError(
                        f"{what}: ranks {missing} of {self.world_size} did not finish in "
                        f"{timeout} s"
                    ) from None
                continue
            if kind == "error":
                raise RuntimeError(f"{what}: worker {rank} failed:\n{value}")
            got[rank] = (kind, value)
        return [got[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (kill those that do not exit in time; ``kill``: at once, as after a
        failure, when a rank may wait in a collective forever)."""
        for p, q in zip(self._procs, self._tasks, strict=True):
            if kill:
                p.kill()
            elif p.is_alive():
                with contextlib.suppress(OSError, ValueError):  # a queue already broken
                    q.put(None)
        deadline = time.monotonic() + _EXIT_GRACE
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._tasks = [], []  # closed: closing again does nothing


class Workers:
    """One :class:`WorkerPool` per world size, started at its first run and again after one
    failed; ``run`` as ``gravac.launch.spawn_workers``."""

    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}
        #: pools started, all world sizes together
        self.started = 0

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
    ) -> list[Any]:
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self.pools[world_size] = WorkerPool(world_size)
            self.started += 1
        return pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
