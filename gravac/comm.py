"""Collectives over ``torch.distributed``, or a single worker when no process group exists.

Payloads of all-reduce compressors are summed in place; payloads of all-gather compressors are
gathered into one tensor per rank (every rank's payload has the same, CF-determined size, so no
size exchange is needed). A small float64 vector of per-step scalars is all-gathered so that
every rank reduces it in the same order and takes identical decisions. A sparse gradient
(``nn.Embedding(sparse=True)``) is averaged as sparse rows, uncompressed
(:meth:`Communicator.sparse_mean_async`).

The ``*_async`` methods and :meth:`Communicator.send_payload` start a collective and return a
:class:`torch.futures.Future` (the step engine chains decompression and the step's bookkeeping
on them); with one rank they return futures that have already completed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gravac.compressors.base import Collective, Payload, StatsOp, payload_tensors

__all__ = ["Communicator", "collect"]

T = TypeVar("T")


def _done(value: T) -> Future[T]:
    """A future that has already completed with ``value``."""
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


def _future(work: dist.Work | None) -> Future[Any]:
    if work is None:  # not a member of the group: nothing to wait for
        return _done(None)
    return work.get_future()


def _then_value(fut: Future[Any], value: T) -> Future[T]:
    """A future that completes with ``value`` once ``fut`` has (errors propagate)."""

    def finish(f: Future[Any]) -> T:
        f.value()  # raises the collective's error, if any
        return value

    return fut.then(finish)


def collect(futures: Sequence[Future[Any]]) -> Future[list[Any]]:
    """A future that completes with every future's value once all have (errors propagate)."""

    def values(f: Future[list[Future[Any]]]) -> list[Any]:
        return [g.value() for g in f.value()]

    return torch.futures.collect_all(list(futures)).then(values)


class Communicator:
    """Thin wrapper of a process group (``None``: the default group if initialised, else 1 rank).

    Args:
        group: the process group; ``None`` uses the default group when one is initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        self.group = group
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.backend: str | None = dist.get_backend(group) if self.distributed else None

    def all_reduce_(self, tensors: Sequence[Tensor], op: StatsOp = "sum") -> None:
        """Reduce ``tensors`` in place across ranks (``sum`` or ``max``)."""
        if self.world_size == 1:
            return
        rop = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        works = [dist.all_reduce(t, op=rop, group=self.group, async_op=True) for t in tensors]
        for w in works:
            if w is not None:
                w.wait()

    @property
    def device(self) -> torch.device:
        """Where this group's small tensors (scalars, digests) live: the current CUDA device
        under NCCL, the CPU otherwise."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_async(self, tensor: Tensor, op: StatsOp = "sum") -> Future[Tensor]:
        """Start reducing ``tensor`` in place; the future completes with it, reduced."""
        if self.world_size == 1:
            return _done(tensor)
        rop = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(tensor, op=rop, group=self.group, async_op=True)
        return _then_value(_future(work), tensor)

    def all_gather_async(self, tensor: Tensor) -> Future[list[Tensor]]:
        """Start gathering every rank's ``tensor`` (all of one shape); the future completes
        with them in rank order."""
        if self.world_size == 1:
            return _done([tensor])
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True)
        return _then_value(_future(work), out)

    def sparse_mean_async(self, grad: Tensor) -> Future[Tensor]:
        """Start averaging the sparse COO tensor ``grad`` across ranks, as DDP's all-reduce of
        a sparse gradient does: each rank's tensor, divided by the world size and coalesced,
        is all-gathered as rows (its indices and values, padded to the largest count, which
        is all-gathered first, blocking), and the future completes with their sum in rank
        order, coalesced: bit for bit gloo's sparse all-reduce of the divided tensors, made
        of all-gathers only (NCCL has no sparse all-reduce).
        """
        local = (grad / self.world_size).coalesce()
        if self.world_size == 1:
            return _done(local)
        indices, values = local.indices(), local.values()
        count = torch.tensor([values.shape[0]], dtype=torch.int64, device=values.device)
        counts = [int(c) for c in self.all_gather(count)]
        most = max(counts)
        if most == 0:  # no rank has a row: every rank knows it from the counts
            return _done(local)
        padded_indices = indices.new_zeros((indices.shape[0], most))
        padded_indices[:, : counts[self.rank]] = indices
        padded_values = values.new_zeros((most, *values.shape[1:]))
        padded_values[: counts[self.rank]] = values
        gathered = [self.all_gather_async(padded_indices), self.all_gather_async(padded_values)]

        def total(f: Future[list[list[Tensor]]]) -> Tensor:
            all_indices, all_values = f.value()
            out = None
            for i, v, n in zip(all_indices, all_values, counts, strict=True):
                t = torch.sparse_coo_tensor(i[:, :n], v[:n], local.shape, check_invariants=False)
                out = t if out is None else out + t  # gloo's order, for its bits
            assert out is not None
            return out.coalesce()

        return collect(gathered).then(total)

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
            dist.broadcast(flat, src=src, group=self.group)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (all of one shape), in rank order."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def send_payload(
        self, payload: Payload, collective: Collective, *, in_place: bool = False
    ) -> Future[list[Payload]]:
        """Start aggregating ``payload``: ``"allreduce"`` sums every tensor (the future
        completes with the one summed payload), ``"allgather"`` gathers them (every rank's
        payload, in rank order). The payload's own tensors are not modified, unless
        ``in_place`` (an all-reduce then sums into them: for a payload nobody reads again)."""
        names = [f.name for f in dataclasses.fields(payload)]
        tensors = [t.contiguous() for t in payload_tensors(payload)]
        if collective == "allreduce":
            summed = tensors if in_place else [t.clone() for t in tensors]
            futs: list[Future[Any]] = [self.all_reduce_async(t) for t in summed]

            def reduced(_: Future[list[Any]]) -> list[Payload]:
                return [dataclasses.replace(payload, **dict(zip(names, summed, strict=True)))]

            return collect(futs).then(reduced)

        def gathered(f: Future[list[list[Tensor]]]) -> list[Payload]:
            per_field = f.value()
            return [
                dataclasses.replace(
                    payload, **{n: g[r] for n, g in zip(names, per_field, strict=True)}
                )
                for r in range(self.world_size)
            ]

        return collect([self.all_gather_async(t) for t in tensors]).then(gathered)
