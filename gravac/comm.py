"""Collectives over ``torch.distributed``, or a single worker when no process group exists.

Payloads of all-reduce compressors are summed in place; payloads of all-gather compressors are
gathered into one tensor per rank (every rank's payload has the same, CF-determined size, so no
size exchange is needed). A small float64 vector of per-step scalars is all-gathered so that
every rank reduces it in the same order and takes identical decisions. A sparse gradient
(``nn.Embedding(sparse=True)``) is averaged as sparse rows, uncompressed
(:meth:`Communicator.sparse_mean_async`).

The ``*_async`` methods and :meth:`Communicator.send_payload` start collectives and return an
:class:`Arrival`: the process group's work objects and how their outputs make the result, which
is made on the thread that waits for it (with one rank, there is nothing to wait for). No gravac
code runs in a callback on the group's threads. Such a callback (its run, or only its release,
which takes the GIL) can still be due there when a failed step ends the process: the thread then
exits inside gloo's exception handler while the interpreter finalizes, and the process aborts
("terminate called after throwing an instance of 'gloo::IoException'", SIGABRT) instead of
exiting with the error.

A collective that fails raises :class:`CollectiveError`, which names it (the engine adds the step
and the unit) and quotes the process group's message once. With a ``timeout``, a collective
that has not completed that long after it started raises :class:`StepTimeoutError`; the
collective itself is started with the backend's per-operation timeout a little longer
(:data:`BACKEND_MARGIN`), so that gloo then fails it and frees its thread, and the process can
exit without waiting for the group's own timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from gravac.compressors.base import Collective, Payload, StatsOp, payload_tensors

__all__ = [
    "BACKEND_MARGIN",
    "Arrival",
    "CollectiveError",
    "Communicator",
    "StepTimeoutError",
    "collect",
]

T = TypeVar("T")
S = TypeVar("S")
#: a collective's options, which take a timeout
_Options = TypeVar("_Options", AllgatherOptions, AllToAllOptions, ReduceScatterOptions)

#: seconds the backend's per-operation timeout exceeds the step timeout: gravac's wait expires
#: first (and names the collective), then the backend fails the collective and frees its thread
#: (gloo: "Timed out waiting ... for recv operation"), so the process exits this much later at
#: most, not after the group's own timeout (30 minutes by default)
BACKEND_MARGIN = 1.0
#: the shortest wait handed to ``Work.wait``: it counts whole milliseconds and reads zero as
#: "no timeout" (a shorter remainder counts as expired)
_SHORTEST_WAIT = 1e-3


class CollectiveError(RuntimeError):
    """A collective that gravac started failed (a rank died, a connection broke). The message
    names the step and the collective, then quotes the process group's own message.

    Args:
        collective: what failed, in words ("the all-gather of unit 3's payload (...)").
        cause: the process group's message.
        step: the gravac step (the engine's step count) it belonged to; ``None``: none.
    """

    def __init__(self, collective: str, cause: str, step: int | None = None) -> None:
        super().__init__(collective, cause, step)  # the arguments, which pickle rebuilds it from
        self.collective, self.cause, self.step = collective, cause, step

    def _where(self) -> str:
        return "gravac: " if self.step is None else f"gravac step {self.step}: "

    def __str__(self) -> str:
        return f"{self._where()}{self.collective} failed: {self.cause}"


class StepTimeoutError(CollectiveError):
    """A collective that gravac started had not completed ``timeout`` seconds after it started
    (``GravacConfig.step_timeout``): some rank has stopped, hangs, or lags behind the others by
    more than that. The process group is not usable after it: end the process.

    Args:
        collective, step: as :class:`CollectiveError`.
        timeout: the step timeout, seconds.
    """

    def __init__(self, collective: str, step: int | None, timeout: float) -> None:
        RuntimeError.__init__(self, collective, step, timeout)
        self.collective, self.step, self.timeout = collective, step, timeout
        self.cause = f"not complete after {timeout:g} s"

    def __str__(self) -> str:
        return (
            f"{self._where()}{self.collective} did not complete within step_timeout="
            f"{self.timeout:g} s: a rank has stopped, hangs, or lags behind the others by more "
            "than that; or it ran out of data and took fewer steps (uneven inputs: train inside "
            "torch.distributed.algorithms.Join([opt]), or DDP's Join with the hook)"
        )


@dataclass(frozen=True)
class _Part:
    """One collective in flight, and what to call it in an error.

    Attributes:
        work: the process group's work object (completed by the group's threads).
        kind: ``"all-reduce"``, ``"all-gather"`` or ``"broadcast"``.
        started: ``time.monotonic()`` just before it was started.
        timeout: the step timeout, seconds (``None``: none, the group's own applies).
        name: what it carries ("unit 3's payload (...)"; empty: unnamed).
    """

    work: dist.Work
    kind: str
    started: float
    timeout: float | None
    name: str = ""

    def wait(self, step: int | None) -> None:
        """Wait for the collective, until its deadline where it has one.

        Raises:
            StepTimeoutError: not complete at its deadline.
            CollectiveError: it failed.
        """
        what = f"the {self.kind} of {self.name}" if self.name else f"an {self.kind}"
        if self.timeout is not None and not self._complete_in_time(self.timeout):
            raise StepTimeoutError(what, step, self.timeout)
        try:
            self.work.wait()  # complete: returns, or raises the collective's own error
        except RuntimeError as exc:  # the process group's error (DistBackendError and kin)
            raise CollectiveError(what, str(exc), step) from None

    def _complete_in_time(self, timeout: float) -> bool:
        """Wait until the collective completes or ``timeout`` after its start passes; whether
        it completed."""
        remaining = self.started + timeout - time.monotonic()
        if remaining >= _SHORTEST_WAIT:
            # raises if it failed or the wait expired: is_completed tells the two apart
            with contextlib.suppress(RuntimeError):
                self.work.wait(timeout=datetime.timedelta(seconds=remaining))
        return self.work.is_completed()


class Arrival(Generic[T]):
    """What collectives in flight deliver: the result is made by :meth:`wait`, once every
    collective has completed, on the thread that calls it (see the module docstring).

    Args:
        parts: the collectives, in the order they were started.
        make: the result, from the completed collectives' outputs.
        step: the step named in errors (``None``: none).
    """

    def __init__(
        self, parts: Sequence[_Part], make: Callable[[], T], step: int | None = None
    ) -> None:
        self.parts = tuple(parts)
        self._make = make
        self._step = step
        self._made: list[T] = []  # the result, once made

    def named(self, name: str) -> Arrival[T]:
        """This arrival, its collectives called ``name`` in errors ("unit 3's payload")."""
        parts = [dataclasses.replace(p, name=name) for p in self.parts]
        return Arrival(parts, self.wait, self._step)

    def map(self, fn: Callable[[T], S]) -> Arrival[S]:
        """An arrival of ``fn`` of this one's result."""
        return Arrival(self.parts, lambda: fn(self.wait()), self._step)

    def ready(self) -> bool:
        """Whether every collective has completed (or failed: :meth:`wait` then raises),
        without waiting."""
        return all(p.work.is_completed() for p in self.parts)

    def wait(self) -> T:
        """Wait for every collective, in the order they were started, and return the result.

        Raises:
            StepTimeoutError: a collective was not complete at its deadline (the step timeout
                after it started).
            CollectiveError: a collective failed (a rank died, a connection broke); either
                error names the first collective, in start order, that did not complete.
        """
        if not self._made:
            for part in self.parts:
                part.wait(self._step)
            self._made.append(self._make())
        return self._made[0]

    #: the result, waiting for it first where needed (the name the engine reads it by)
    value = wait


def _done(value: T) -> Arrival[T]:
    """An arrival with nothing to wait for (a single worker)."""
    return Arrival((), lambda: value)


def collect(arrivals: Sequence[Arrival[Any]], step: int | None = None) -> Arrival[list[Any]]:
    """Every arrival's result, in order, once all have arrived; errors name ``step`` (``None``:
    none) and the first collective, in start order, that did not complete."""
    parts = sorted((p for a in arrivals for p in a.parts), key=lambda p: p.started)

    def results() -> list[Any]:
        return [a.wait() for a in arrivals]

    return Arrival(parts, results, step)


class Communicator:
    """Thin wrapper of a process group (``None``: the default group if initialised, else 1 rank).

    Args:
        group: the process group; ``None`` uses the default group when one is initialised.
        timeout: seconds a collective may take (:class:`StepTimeoutError` past it; the backend
            fails it :data:`BACKEND_MARGIN` later); ``None``: the group's own timeout (30
            minutes by default), past which it fails with :class:`CollectiveError`.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, timeout: float | None = None
    ) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        self.group = group
        self.timeout = timeout
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.backend: str | None = dist.get_backend(group) if self.distributed else None

    def joined(self) -> Communicator:
        """A communicator of the default group, as now, with this one's timeout (for a group
        that appeared after this one was made)."""
        return Communicator(None, timeout=self.timeout)

    @property
    def device(self) -> torch.device:
        """Where this group's small tensors (scalars, digests) live: the current CUDA device
        under NCCL, the CPU otherwise."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ starting collectives
    def _process_group(self) -> dist.ProcessGroup:
        group = self.group if self.group is not None else dist.group.WORLD
        assert group is not None  # distributed: the default group exists
        return group

    def _backend_timeout(self) -> datetime.timedelta:
        """The backend's per-operation timeout for a collective under :attr:`timeout`."""
        assert self.timeout is not None
        return datetime.timedelta(seconds=self.timeout + BACKEND_MARGIN)

    def _parts(self, kind: str, work: dist.Work | None, started: float) -> list[_Part]:
        if work is None:  # not a member of the group: nothing to wait for
            return []
        return [_Part(work, kind, started, self.timeout)]

    def _all_reduce(self, tensor: Tensor, op: StatsOp) -> list[_Part]:
        """Start reducing ``tensor`` in place."""
        started = time.monotonic()
        rop = dist.ReduceOp(dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if self.timeout is None:
            work = dist.all_reduce(tensor, op=rop, group=self.group, async_op=True)
        else:
            opts = AllreduceOptions()
            opts.reduceOp = rop
            opts.timeout = self._backend_timeout()
            work = self._process_group().allreduce([tensor], opts)
        return self._parts("all-reduce", work, started)

    def _all_gather(self, out: list[Tensor], tensor: Tensor) -> list[_Part]:
        """Start gathering every rank's ``tensor`` into ``out``."""
        started = time.monotonic()
        if self.timeout is None:
            work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        else:
            opts = AllgatherOptions()
            opts.timeout = self._backend_timeout()
            work = self._process_group().allgather([out], [tensor], opts)
        return self._parts("all-gather", work, started)

    def _timed(self, opts: _Options) -> _Options:
        """``opts`` with the backend's timeout under :attr:`timeout`, if there is one."""
        if self.timeout is not None:
            opts.timeout = self._backend_timeout()
        return opts

    def _reduce_scatter(self, out: Tensor, tensor: Tensor) -> list[_Part]:
        """Start summing ``tensor`` (``world_size`` equal chunks) over ranks, rank ``r``'s
        chunk into ``out``."""
        started = time.monotonic()
        opts = self._timed(ReduceScatterOptions())
        work = self._process_group()._reduce_scatter_base(out, tensor, opts)
        return self._parts("reduce-scatter", work, started)

    def _gather_into(self, out: Tensor, tensor: Tensor) -> list[_Part]:
        """Start gathering every rank's ``tensor`` into ``out``, end to end in rank order."""
        started = time.monotonic()
        work = self._process_group()._allgather_base(out, tensor, self._timed(AllgatherOptions()))
        return self._parts("all-gather", work, started)

    def _all_to_all(self, out: Tensor, tensor: Tensor) -> list[_Part]:
        """Start sending chunk ``r`` of ``tensor`` (``world_size`` equal chunks) to rank ``r``,
        every rank's chunk for this one into ``out``, end to end in rank order."""
        started = time.monotonic()
        opts = self._timed(AllToAllOptions())
        work = self._process_group().alltoall_base(out, tensor, [], [], opts)
        return self._parts("all-to-all", work, started)

    def _broadcast(self, tensor: Tensor, src: int) -> list[_Part]:
        """Start overwriting ``tensor`` with global rank ``src``'s."""
        started = time.monotonic()
        if self.timeout is None:
            work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        else:
            opts = BroadcastOptions()
            opts.rootRank = src if self.group is None else dist.get_group_rank(self.group, src)
            opts.rootTensor = 0
            opts.timeout = self._backend_timeout()
            work = self._process_group().broadcast([tensor], opts)
        return self._parts("broadcast", work, started)

    # ------------------------------------------------------------------ collectives
    def all_reduce_(
        self,
        tensors: Sequence[Tensor],
        op: StatsOp = "sum",
        *,
        name: str = "",
        step: int | None = None,
    ) -> None:
        """Reduce ``tensors`` in place across ranks (``sum`` or ``max``); errors call them
        ``name`` and name ``step``."""
        if self.world_size == 1:
            return
        parts = [p for t in tensors for p in self._all_reduce(t, op)]
        Arrival(parts, lambda: None, step).named(name).wait()

    def reduce_scatter_async(
        self, tensor: Tensor, *, name: str = "", step: int | None = None
    ) -> Arrival[Tensor]:
        """Start summing this rank's chunk of ``tensor`` over ranks: ``tensor`` (flat, a
        multiple of :attr:`world_size` elements, unchanged until the arrival is waited for)
        cut into ``world_size`` equal chunks, rank ``r`` receiving chunk ``r`` summed, in a new
        tensor. Errors call it ``name`` and name ``step``."""
        out = torch.empty(
            tensor.numel() // self.world_size, dtype=tensor.dtype, device=tensor.device
        )
        if self.world_size == 1:
            return _done(out.copy_(tensor))
        parts = self._reduce_scatter(out, tensor.contiguous())
        return Arrival(parts, lambda: out, step).named(name)

    def all_to_all_async(
        self, tensor: Tensor, *, name: str = "", step: int | None = None
    ) -> Arrival[Tensor]:
        """Start exchanging chunks: ``tensor`` (flat, a multiple of :attr:`world_size`
        elements, unchanged until the arrival is waited for) cut into ``world_size`` equal
        chunks, chunk ``r`` sent to rank ``r``; the arrival is a new tensor of this rank's
        chunk from every rank, end to end in rank order. Errors call it ``name`` and name
        ``step``."""
        if self.world_size == 1:
            return _done(tensor.clone())
        out = torch.empty_like(tensor)
        parts = self._all_to_all(out, tensor.contiguous())
        return Arrival(parts, lambda: out, step).named(name)

    def all_gather_into(
        self, out: Tensor, tensor: Tensor, *, name: str = "", step: int | None = None
    ) -> Tensor:
        """``out`` (flat, ``world_size`` times ``tensor``'s elements) filled with every rank's
        ``tensor``, end to end in rank order. Errors call it ``name`` and name ``step``."""
        if self.world_size == 1:
            return out.copy_(tensor.reshape(-1))
        parts = self._gather_into(out, tensor.contiguous())
        return Arrival(parts, lambda: out, step).named(name).wait()

    def barrier_async(self, *, name: str = "", step: int | None = None) -> Arrival[None]:
        """Start a barrier: an all-reduce of one element, which completes on a rank once every
        rank has started it (so every rank has done what it did before). Errors call it
        ``name`` and name ``step``."""
        if self.world_size == 1:
            return _done(None)
        token = torch.zeros(1, device=self.device)
        return Arrival(self._all_reduce(token, "sum"), lambda: None, step).named(name)

    def all_reduce_async(self, tensor: Tensor, op: StatsOp = "sum") -> Arrival[Tensor]:
        """Start reducing ``tensor`` in place; the arrival is it, reduced."""
        if self.world_size == 1:
            return _done(tensor)
        return Arrival(self._all_reduce(tensor, op), lambda: tensor)

    def all_gather_async(self, tensor: Tensor) -> Arrival[list[Tensor]]:
        """Start gathering every rank's ``tensor`` (all of one shape); the arrival is them, in
        rank order."""
        if self.world_size == 1:
            return _done([tensor])
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        return Arrival(self._all_gather(out, tensor.contiguous()), lambda: out)

    def sparse_mean_async(self, grad: Tensor) -> Arrival[Tensor]:
        """Start averaging the sparse COO tensor ``grad`` across ranks, as DDP's all-reduce of
        a sparse gradient does: each rank's tensor, divided by the world size and coalesced,
        is all-gathered as rows (its indices and values, padded to the largest count, which
        is all-gathered first, blocking), and the arrival is their sum in rank order,
        coalesced: bit for bit gloo's sparse all-reduce of the divided tensors, made of
        all-gathers only (NCCL has no sparse all-reduce).
        """
        local = (grad / self.world_size).coalesce()
        if self.world_size == 1:
            return _done(local)
        indices, values = local.indices(), local.values()
        count = torch.tensor([values.shape[0]], dtype=torch.int64, device=values.device)
        counts = [int(c) for c in self.all_gather_async(count).named("the row counts").wait()]
        most = max(counts)
        if most == 0:  # no rank has a row: every rank knows it from the counts
            return _done(local)
        padded_indices = indices.new_zeros((indices.shape[0], most))
        padded_indices[:, : counts[self.rank]] = indices
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: counts[self.rank]] = values
        gathered = [self.all_gather_async(padded_indices), self.all_gather_async(padded_values)]

        def total(arrived: list[list[Tensor]]) -> Tensor:
            all_indices, all_values = arrived
            out = None
            for i, v, n in zip(all_indices, all_values, counts, strict=True):
                t = torch.sparse_coo_tensor(i[:, :n], v[:n], local.shape, check_invariants=False)
                out = t if out is None else out + t  # gloo's order, for its bits
            assert out is not None
            return out.coalesce()

        return collect(gathered).named("the sparse gradient's rows").map(total)

    def broadcast_(self, tensors: Sequence[Tensor], src: int | None = None) -> None:
        """Overwrite ``tensors`` with those of global rank ``src`` (``None``: the group's first
        rank), one collective per dtype and device (coalesced)."""
        if self.world_size == 1:
            return
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        if src is None:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            Arrival(self._broadcast(flat, src), lambda: None).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def send_payload(
        self, payload: Payload, collective: Collective, *, in_place: bool = False
    ) -> Arrival[list[Payload]]:
        """Start aggregating ``payload``: ``"allreduce"`` sums every tensor (the arrival is the
        one summed payload), ``"allgather"`` gathers them (every rank's payload, in rank order).
        The payload's own tensors are not modified, unless ``in_place`` (an all-reduce then sums
        into them: for a payload nobody reads again)."""
        names = [f.name for f in dataclasses.fields(payload)]
        tensors = [t.contiguous() for t in payload_tensors(payload)]
        if collective == "allreduce":
            summed = tensors if in_place else [t.clone() for t in tensors]

            def reduced(sums: list[Tensor]) -> list[Payload]:
                return [dataclasses.replace(payload, **dict(zip(names, sums, strict=True)))]

            return collect([self.all_reduce_async(t) for t in summed]).map(reduced)

        def gathered(per_field: list[list[Tensor]]) -> list[Payload]:
            return [
                dataclasses.replace(
                    payload, **{n: g[r] for n, g in zip(names, per_field, strict=True)}
                )
                for r in range(self.world_size)
            ]

        return collect([self.all_gather_async(t) for t in tensors]).map(gathered)
