"""Collectives over ``torch.distributed``, or a single worker when no process group exists.

Payloads of all-reduce compressors are summed in place; payloads of all-gather compressors are
gathered into one tensor per rank (every rank's payload has the same, CF-determined size, so no
size exchange is needed). A small float64 vector of per-step scalars is all-gathered so that
every rank reduces it in the same order and takes identical decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gravac.compressors.base import Payload, StatsOp, payload_tensors

__all__ = ["Communicator"]


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

    def all_reduce_(self, tensors: Sequence[Tensor], op: StatsOp = "sum") -> None:
        """Reduce ``tensors`` in place across ranks (``sum`` or ``max``)."""
        if self.world_size == 1:
            return
        rop = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        works = [dist.all_reduce(t, op=rop, group=self.group, async_op=True) for t in tensors]
        for w in works:
            if w is not None:
                w.wait()

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

    def reduce_payload(self, payload: Payload) -> Payload:
        """All-reduce (sum) every tensor of ``payload``; returns the summed payload."""
        tensors = [t.contiguous().clone() for t in payload_tensors(payload)]
        self.all_reduce_(tensors)
        names = [f.name for f in dataclasses.fields(payload)]
        return dataclasses.replace(payload, **dict(zip(names, tensors, strict=True)))

    def gather_payload(self, payload: Payload) -> list[Payload]:
        """Every rank's ``payload``, in rank order."""
        names = [f.name for f in dataclasses.fields(payload)]
        gathered = [self.all_gather(t) for t in payload_tensors(payload)]
        return [
            dataclasses.replace(payload, **{n: g[r] for n, g in zip(names, gathered, strict=True)})
            for r in range(self.world_size)
        ]
