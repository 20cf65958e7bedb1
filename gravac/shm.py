"""A node's dense stages of two-level aggregation through shared memory.

:mod:`gravac.hierarchy` sums every unit's gradient inside a node (stage 1, each local rank
receiving its chunk of the node's mean) and gives every rank the node's aggregate back
(stage 3). Over gloo both stages travel through TCP on the loopback, even between processes of
one host. Here the ranks of a node that share a host map :class:`Region` s instead, files in
:data:`SHM_DIRECTORY` that each node's first rank creates and unlinks as soon as every rank of
the node has mapped them (so that none is left behind, even when a process is killed), and:

- stage 1 (:meth:`SharedNodeStage.scatter`): rank ``l`` writes what it sends (its gradient, or
  ``round(g / L)`` in a 16-bit ``wire``) into slot ``l`` of a region and starts a barrier on the
  node's group; once it completes, every slot is written, and the rank sums chunk ``l`` over
  the ``L`` slots, as the owner of a reduce-scatter or of an all-to-all does: the same sum of
  the same values (bit for bit gloo's for ``L = 2``);
- stage 3 (:meth:`SharedNodeStage.gather`): rank ``l`` writes its chunk of the aggregate (in
  ``wire``) at place ``l`` of a region, a barrier, and every rank copies the whole out.

The barriers are collectives of the node's group
(:meth:`gravac.comm.Communicator.barrier_async`), so a rank that dies or hangs fails a stage as
it fails any collective. A region serves the ``i``-th stage of its kind in every step
(:meth:`SharedNodeStage.restart` begins a step; the same on every rank: the engine runs the
stages in launch order). Before a rank writes into a region again, it waits until every rank
of the node has finished reading the region's last use (:meth:`Region.begin`: a counter a rank,
in the region), which in practice each has long before. What this saves on the test bed:
``docs/studies/2026-12-04-two-level.md``, last section.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid

import torch
from torch import Tensor

from gravac.comm import Arrival, Communicator, StepTimeoutError

__all__ = ["SHM_DIRECTORY", "Region", "SharedMemoryError", "SharedNodeStage", "map_region"]

#: where a node's regions are created: a tmpfs on Linux, shared by the processes of a host
SHM_DIRECTORY = "/dev/shm"
#: bytes of a region's name as the node's first rank sends it to the others (a uuid in hex)
_NAME_BYTES = 32
#: bytes before a region's data: the ranks' counters (int64 each), rounded up to a cache line
_HEADER_ALIGN = 64
#: seconds between two looks at a region's counters while a rank still reads its last use
_POLL_SECONDS = 1e-4
#: seconds a rank waits for the others to finish reading a region where the node's group has
#: no step timeout (torch.distributed's own default timeout for a process group)
_DEFAULT_WAIT = 1800.0


def _header_bytes(ranks: int) -> int:
    """Bytes of the counters of ``ranks`` ranks, rounded up to :data:`_HEADER_ALIGN`."""
    return -(-8 * ranks // _HEADER_ALIGN) * _HEADER_ALIGN


def _create(path: str, nbytes: int) -> None:
    """A new file of ``nbytes`` zero bytes at ``path``, its space reserved where the system
    can (``posix_fallocate``: a tmpfs too small for it fails here, with ``ENOSPC``, rather
    than with ``SIGBUS`` at a later write into the mapping); no file where it fails."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def map_region(
    node: Communicator, nbytes: int, *, directory: str = SHM_DIRECTORY
) -> tuple[Tensor | None, str]:
    """``nbytes`` bytes of a new file in ``directory``, mapped shared by every rank of the
    ``node`` group (a collective of the group), zeros; ``(None, why)`` on every rank of the
    node where some rank could not create or map it (``why``: this rank's reason, or that
    another rank failed). The node's first rank creates the file and unlinks it once every
    rank has tried to map it."""
    owner = node.rank == 0
    path, why = "", ""
    name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if owner:
        token = uuid.uuid4().hex
        path = os.path.join(directory, f"gravac-node-{token}")
        try:
            _create(path, nbytes)
            name.copy_(torch.frombuffer(bytearray(token.encode()), dtype=torch.uint8))
        except OSError as exc:
            why = f"could not create {path!r} of {nbytes} bytes ({exc})"
    node.broadcast_([name])
    mem: Tensor | None = None
    if not why and bool(name.any()):
        path = os.path.join(directory, f"gravac-node-{bytes(name.tolist()).decode()}")
        try:
            mem = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError) as exc:
            why = f"could not map {path!r} ({exc})"
    elif not why:
        why = "the node's first rank could not create its file"
    mapped = torch.tensor([float(mem is not None)])
    node.all_reduce_([mapped], name="the node's shared memory")
    if owner and path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if int(mapped.item()) != node.world_size:
        return None, why or "another rank of the node could not map the file"
    return mem, ""


def _sum_rows(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``rows.sum(0, dtype=dtype)`` of two or more rows, added row after row into a new tensor
    (in ``dtype``, each row converted exactly before it is added): one pass a row where torch's
    reduction over a strided first dimension takes two."""
    # a row of another dtype is copied first (to() of the same dtype would not copy)
    same = rows.dtype == dtype
    out = torch.add(rows[0], rows[1]) if same else rows[0].to(dtype).add_(rows[1])
    for row in rows[2:]:
        out.add_(row)
    return out


class SharedMemoryError(RuntimeError):
    """A node could not map a region for a stage (on every rank of the node alike)."""


class Region:
    """A file mapped by the ``ranks`` ranks of a node: a counter for each rank (how many uses
    of the region it has finished reading), then the data.

    Args:
        mem: the mapping, from :func:`map_region`, :meth:`nbytes_for` ``(ranks, data)`` bytes.
        ranks: the node's ranks (``L``).
        local: this rank's index among them.
    """

    def __init__(self, mem: Tensor, ranks: int, local: int) -> None:
        head = _header_bytes(ranks)
        self.done = mem[:head].view(torch.int64)[:ranks]  # uses each rank finished reading
        self.data = mem[head:]
        self.local = local
        self.uses = 0  # uses this rank began (the same on every rank)

    @staticmethod
    def nbytes_for(ranks: int, data: int) -> int:
        """The mapping's bytes for ``data`` bytes of data among ``ranks`` ranks."""
        return _header_bytes(ranks) + data

    def view(self, dtype: torch.dtype, numel: int) -> Tensor:
        """The first ``numel`` elements of the data, as ``dtype``."""
        return self.data[: numel * dtype.itemsize].view(dtype)

    def begin(self, timeout: float | None, what: str, step: int | None) -> None:
        """Start a use: mark the last one finished here (read, or dropped unread), then wait
        until every rank of the node has finished it, so that nothing it still reads is
        overwritten.

        Raises:
            StepTimeoutError: a rank still had not finished ``timeout`` seconds later.
        """
        self.done[self.local] = self.uses
        wait = _DEFAULT_WAIT if timeout is None else timeout
        deadline = time.monotonic() + wait
        while int(self.done.min()) < self.uses:
            if time.monotonic() > deadline:
                raise StepTimeoutError(f"the node's reading of {what}", step, wait)
            time.sleep(_POLL_SECONDS)
        self.uses += 1

    def finish(self) -> None:
        """This rank has finished reading the use begun last."""
        self.done[self.local] = self.uses


class SharedNodeStage:
    """Stages 1 and 3 of two-level aggregation (:mod:`gravac.hierarchy`) for one node's
    ranks, through :class:`Region` s they share (see the module docstring).

    Args:
        node: the node's group (its barriers, and the regions' creation).
        directory: where the regions are created.
    """

    def __init__(self, node: Communicator, *, directory: str = SHM_DIRECTORY) -> None:
        self.node = node
        self.directory = directory
        self.ranks, self.local = node.world_size, node.rank
        self._regions: dict[str, list[Region]] = {"scatter": [], "gather": []}
        self._used = {"scatter": 0, "gather": 0}  # stages of each kind since restart()

    def usable(self) -> str:
        """Why this node cannot share memory (``""``: it can): a region of one byte, mapped
        by every rank of the node (a collective of the node's group)."""
        _, why = map_region(self.node, Region.nbytes_for(self.ranks, 1), directory=self.directory)
        return why

    def mapped_bytes(self) -> int:
        """Bytes of data in the regions this rank maps (each shared by the node's ranks)."""
        return sum(r.data.numel() for regions in self._regions.values() for r in regions)

    def restart(self) -> None:
        """A new step begins: its stages take the regions from the first again (every rank of
        the node begins its steps alike)."""
        self._used = dict.fromkeys(self._used, 0)

    def _region(self, kind: str, nbytes: int, step: int | None) -> Region:
        """The region of this step's next stage of ``kind``, of at least ``nbytes`` bytes of
        data: the one that stage used last step where large enough, else a new one (a
        collective of the node's group, at the same stage on every rank).

        Raises:
            SharedMemoryError: the node could not map a new one (on every rank of the node).
        """
        regions, i = self._regions[kind], self._used[kind]
        self._used[kind] += 1
        if i < len(regions) and regions[i].data.numel() >= nbytes:
            return regions[i]
        mem, why = map_region(
            self.node, Region.nbytes_for(self.ranks, nbytes), directory=self.directory
        )
        if mem is None:
            raise SharedMemoryError(f"the node's memory failed at step {step}: {why}")
        region = Region(mem, self.ranks, self.local)
        if i < len(regions):
            regions[i] = region
        else:
            regions.append(region)
        return region

    def scatter(
        self, flat: Tensor, size: int, wire: torch.dtype, step: int | None
    ) -> Arrival[Tensor]:
        """Start summing this rank's chunk of the node's ``flat`` (stage 1), padded with zeros
        to ``size`` elements (``L`` equal chunks: :meth:`gravac.hierarchy.Topology.padded`):
        ``flat`` sent in ``wire``, divided by ``L`` first where ``wire`` is not ``flat``'s
        dtype; the arrival is a new tensor of ``size / L`` elements in ``flat``'s dtype, the
        chunk's sum over the node's ranks, divided by ``L`` where ``wire`` is ``flat``'s dtype:
        the node's mean either way, on ``flat``'s device.

        Raises:
            SharedMemoryError: the node could not map a larger region (every rank of it).
        """
        n, chunk = flat.numel(), size // self.ranks
        region = self._region("scatter", self.ranks * size * wire.itemsize, step)
        region.begin(self.node.timeout, "a unit's node sum", step)
        slots = region.view(wire, self.ranks * size).view(self.ranks, size)
        mine = slots[self.local]
        if wire != flat.dtype:  # divided first: float16 overflows only where the mean would
            torch.mul(flat.reshape(-1), 1.0 / self.ranks, out=mine[:n])
        else:
            mine[:n].copy_(flat.reshape(-1))
        mine[n:].zero_()
        own = slice(self.local * chunk, (self.local + 1) * chunk)
        exact, use = wire == flat.dtype, region.uses

        def summed(_: None) -> Tensor:
            if region.uses != use:
                raise RuntimeError(
                    f"two levels: a node sum (step {step}) was read after its region was "
                    "used again; wait for a stage's arrival before the next step's stages"
                )
            out = _sum_rows(slots[:, own], flat.dtype)
            region.finish()
            out = out.to(flat.device)
            return out.div_(self.ranks) if exact else out

        barrier = self.node.barrier_async(name="a unit's node sum", step=step)
        return barrier.map(summed)

    def gather(self, sent: Tensor, numel: int, dtype: torch.dtype, step: int | None) -> Tensor:
        """Every rank's ``sent`` (its chunk of the aggregate, flat, as it sends it), end to end
        in local-rank order, cut to ``numel`` elements (stage 3): a new tensor in ``dtype`` on
        ``sent``'s device.

        Raises:
            SharedMemoryError: the node could not map a larger region (every rank of it).
        """
        c = sent.numel()
        region = self._region("gather", self.ranks * c * sent.dtype.itemsize, step)
        region.begin(self.node.timeout, "the node's aggregate", step)
        whole = region.view(sent.dtype, self.ranks * c)
        whole[self.local * c : (self.local + 1) * c].copy_(sent)
        self.node.barrier_async(name="the node's aggregate", step=step).wait()
        out = whole[:numel].to(device=sent.device, dtype=dtype, copy=True)
        region.finish()
        return out
