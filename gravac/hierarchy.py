"""Two-level aggregation: ranks grouped into nodes, compressed once per node and shard.

A cluster is nodes of several ranks: links inside a node are fast, the network between nodes
is slow. Flat aggregation sends every rank's compressed payload across the network; the CLAN /
BytePS-Compress scheme (``../shared/papers/clan-byteps-compress-adaptive-methods.txt``, its
Figure 1) aggregates inside the node first and compresses once per node. Here a node is
``L`` consecutive ranks (torchrun's numbering: global rank ``n * L + l`` is local rank ``l`` of
node ``n``), and a unit's flat gradient ``g_r`` of ``m`` elements, zero-padded to ``L * c``
elements (``c = ceil(m / L)``), goes in three stages:

1. a dense reduce-scatter inside the node: local rank ``l`` holds the node's mean of chunk
   ``l``, ``s_{n,l} = (1/L) sum_{r in node n} g_r[chunk l]`` (:meth:`Hierarchy.scatter`);
2. the engine compresses ``s_{n,l}`` with error feedback (``x = s + e``, a residual per rank and
   chunk) and aggregates it among the ``N`` ranks of local rank ``l``, one per node (its
   *peers*): ``a_l = (1/N) sum_n C(x_{n,l})``, one collective per chunk, the ``L`` chunks in
   parallel;
3. an all-gather inside the node (:meth:`Hierarchy.gather`): every rank holds every ``a_l``,
   so the aggregate of all ``N * L`` ranks (exactly their mean for a compressor that sends
   everything).

Only chunk-sized payloads cross between nodes, one per node and chunk: at the same CF, ``L``
times fewer inter-node bytes a rank than flat aggregation, and one compression error per node
instead of one per rank. The controller sees what crosses between nodes: the peers' payloads,
their gains and times.

Stages 1 and 3 move the whole gradient inside the node, dense. With a 16-bit ``precision``
(:data:`NODE_PRECISIONS`, ``GravacConfig.node_precision``) a compressed unit's stages run in
float16 or bfloat16, half the bytes, as PyTorch's fp16 compression hook sends DDP's buckets:
stage 1 sends ``round(g_r / L)`` (divided before rounding, so that float16 overflows only where
``|g_r| / L`` does: a non-finite chunk skips the step), each chunk to its owner by an
all-to-all, and the owner sums the ``L`` pieces in the gradient's dtype (a 16-bit
reduce-scatter would round every partial sum, and on gloo it took longer: 31.9 against 28.8 ms
for 21 MB on 2 ranks, ``docs/studies/2026-12-04-two-level.md``); stage 3 sends
``round(a_l)``, which every rank applies, the owner too, so that ranks stay identical. The
rounding of stage 3, ``a_l - round(a_l)``, is the same on the ``N`` peers of chunk ``l``; each
adds it to its residual of the chunk (:meth:`gravac.engine.Engine.commit`), so error feedback
sends it again and nothing of the aggregate is lost where the unit keeps a residual. The
rounding of stage 1 is not fed back (each rank's share of it is spread over every chunk, held
by no rank), as under PyTorch's hook. Units sent dense and the residual pieces carried into a
new layout keep float32 (exact).

Stages 1 and 3 run through the node group's collectives, or, over gloo where every rank of the
node maps the same file in ``/dev/shm``, through that memory (:mod:`gravac.shm`: the same sums
without the loopback's TCP; ``node_stage``, :data:`NODE_STAGES`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from gravac.comm import Arrival, Communicator
from gravac.shm import SHM_DIRECTORY, SharedMemoryError, SharedNodeStage

__all__ = [
    "NODE_PRECISIONS",
    "NODE_STAGES",
    "Hierarchy",
    "Topology",
    "group_topology",
    "plan_topology",
    "torchrun_node_size",
]

#: what a node's dense stages may send a compressed unit in, by name: ``None`` is the
#: gradient's own dtype (exact)
NODE_PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

#: how a node's dense stages move the gradient: ``"shm"`` through memory its ranks share
#: (:mod:`gravac.shm`; their group's backend gloo, on one host), ``"collective"`` through the
#: node group's collectives, ``"auto"`` the first where the node can, else the second
NODE_STAGES = ("auto", "shm", "collective")

#: torchrun's variables for a worker's node: ranks on its node, and its index among them
_LOCAL_SIZE, _LOCAL_RANK = "LOCAL_WORLD_SIZE", "LOCAL_RANK"


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in nodes of ``ranks_per_node`` consecutive ranks; this one is
    ``rank``.

    Attributes:
        world_size: ranks in the group.
        ranks_per_node: ranks in each node (``L``), dividing ``world_size``.
        rank: this rank.
    """

    world_size: int
    ranks_per_node: int
    rank: int

    @property
    def nodes(self) -> int:
        """Nodes (``N``)."""
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index in its node (the chunk it owns)."""
        return self.rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node``."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """The ranks of local rank ``local_rank``, one per node: they aggregate one chunk."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))

    def chunk(self, numel: int) -> int:
        """Elements in each chunk of a unit of ``numel`` elements: ``ceil(numel / L)``."""
        return math.ceil(numel / self.ranks_per_node)

    def padded(self, numel: int) -> int:
        """Elements in a unit of ``numel`` elements padded to its ``L`` chunks: ``L * chunk``."""
        return self.chunk(numel) * self.ranks_per_node

    def bounds(self, numel: int) -> tuple[int, int]:
        """Where this rank's chunk lies in a unit of ``numel`` elements (``start, end``; the
        last chunks may reach past ``numel``: their padding is cut off)."""
        c = self.chunk(numel)
        start = min(self.local_rank * c, numel)
        return start, min(start + c, numel)

    def __str__(self) -> str:
        if self.ranks_per_node == 1:
            return f"flat ({self.world_size} rank{'s' * (self.world_size != 1)})"
        return f"{self.nodes} node(s) of {self.ranks_per_node} ranks"


def torchrun_node_size(world_size: int, rank: int, env: Mapping[str, str] | None = None) -> int:
    """Ranks per node as torchrun reports them (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``), where
    that is more than one node of more than one rank, numbered node by node (this rank's
    ``LOCAL_RANK`` is ``rank % LOCAL_WORLD_SIZE``); else 1 (flat).

    Every rank decides from its own variables; the ranks then check that they decided alike
    before any collective depends on it (:meth:`gravac.engine.Engine.agreement_parts`)."""
    env = os.environ if env is None else env
    try:
        size, local = int(env[_LOCAL_SIZE]), int(env[_LOCAL_RANK])
    except (KeyError, ValueError):
        return 1
    if size < 2 or world_size <= size or world_size % size or local != rank % size:
        return 1
    return size


def plan_topology(
    ranks_per_node: int | None, world_size: int, rank: int, env: Mapping[str, str] | None = None
) -> Topology:
    """The topology gravac aggregates in: ``ranks_per_node`` as given (1: flat), or with
    ``None`` as torchrun reports it (:func:`torchrun_node_size`).

    Raises:
        ValueError: ``ranks_per_node`` does not divide ``world_size``.
    """
    size = torchrun_node_size(world_size, rank, env) if ranks_per_node is None else ranks_per_node
    if world_size % size:
        raise ValueError(
            f"ranks_per_node must divide the world size {world_size} (nodes of equal size), "
            f"got {ranks_per_node}"
        )
    return Topology(world_size, size, rank)


def group_topology(comm: Communicator, ranks_per_node: int | None) -> Topology:
    """The nodes a rank of ``comm`` plans to aggregate in (:func:`plan_topology`): flat for
    one worker, and in a group other than the default one (two levels need groups made by
    every rank of the default group).

    Raises:
        ValueError: ``ranks_per_node`` does not divide the world size, or asks for two levels
            in a group other than the default one.
    """
    if not comm.distributed:
        return Topology(1, 1, 0)
    if comm.group is not None and comm.world_size != dist.get_world_size():
        if ranks_per_node is not None and ranks_per_node > 1:
            raise ValueError(
                f"ranks_per_node={ranks_per_node} needs the default process group (two-level "
                "groups are made by every rank of it), got a process_group of "
                f"{comm.world_size} of its {dist.get_world_size()} ranks"
            )
        return Topology(comm.world_size, 1, comm.rank)
    return plan_topology(ranks_per_node, comm.world_size, comm.rank)


class Hierarchy:
    """The node and peer groups of a two-level ``topology`` (every rank of the default group
    must make it, in the same order: ``torch.distributed.new_group`` is collective).

    Args:
        topology: the nodes; ``ranks_per_node >= 2``.
        precision: what stages 1 and 3 send a compressed unit in, a key of
            :data:`NODE_PRECISIONS`.
        timeout: the step timeout of the groups' collectives (:class:`Communicator`).
        stage: how stages 1 and 3 move the gradient, one of :data:`NODE_STAGES`.
        directory: where ``stage`` ``"shm"`` (or ``"auto"``) maps the node's memory.

    Raises:
        RuntimeError: ``stage="shm"`` where the node's group is not gloo, or where some rank
            of the node could not map a file in ``directory`` (on every rank of that node);
            also at a later stage that needs a larger file and cannot map it. Under
            ``"auto"`` the node then moves its stages through its collectives from that
            stage on, with a ``RuntimeWarning``.
    """

    def __init__(
        self,
        topology: Topology,
        *,
        precision: str = "fp32",
        timeout: float | None = None,
        stage: str = "auto",
        directory: str = SHM_DIRECTORY,
    ) -> None:
        self.topology = topology
        #: the 16-bit dtype of a compressed unit's dense stages; None: its own (exact)
        self.wire = NODE_PRECISIONS[precision]
        node_group = peer_group = None
        for n in range(topology.nodes):
            g = dist.new_group(topology.node_ranks(n))
            node_group = g if n == topology.node else node_group
        for local in range(topology.ranks_per_node):
            g = dist.new_group(topology.peer_ranks(local))
            peer_group = g if local == topology.local_rank else peer_group
        #: this rank's node: the reduce-scatter and the all-gather
        self.node = Communicator(node_group, timeout=timeout)
        #: the ranks that own the same chunk, one per node: the compressed aggregation
        self.peers = Communicator(peer_group, timeout=timeout)
        self.stage = stage
        #: stages 1 and 3 through shared memory; None: through :attr:`node`'s collectives
        self.shared = self._share(stage, directory)

    def _share(self, stage: str, directory: str) -> SharedNodeStage | None:
        """The node's shared memory where ``stage`` asks for it and the node can share (the
        same answer on every rank of the node: the check is a collective of its group)."""
        if stage == "collective":
            return None
        why = f"its group's backend is {self.node.backend}, not gloo"
        shared = None
        if self.node.backend == "gloo":
            shared = SharedNodeStage(self.node, directory=directory)
            why = shared.usable()
        if not why:
            return shared
        if stage == "shm":
            raise RuntimeError(f"node_stage='shm', but node {self.topology.node} cannot: {why}")
        return None

    def _unshare(self, error: SharedMemoryError) -> None:
        """The node's memory failed at a stage (on every rank of the node): raise under
        ``"shm"``; else warn and move this and later stages through the collectives."""
        node = self.topology.node
        if self.stage == "shm":
            raise RuntimeError(f"node_stage='shm', but node {node} cannot: {error}") from None
        warnings.warn(
            f"two levels: {error}; node {node} moves its stages through its group's "
            "collectives from now on (node_stage='auto')",
            RuntimeWarning,
            stacklevel=3,
        )
        self.shared = None

    def begin_step(self) -> None:
        """A step begins (the engine's :meth:`gravac.engine.Engine.begin`, on every rank)."""
        if self.shared is not None:
            self.shared.restart()

    def signal_slot(self, payload: Tensor) -> Tensor:
        """``payload`` (:func:`gravac.control.noise.signal_payload`: samples, then an energy)
        as this rank adds it to the all-reduce over every rank: its samples at this rank's
        local rank's place among ``L`` (the chunks' samples summed over nodes, each chunk
        apart, every rank's energy summed), so that every rank estimates one share."""
        t, n = self.topology, payload.numel() - 1
        out = payload.new_zeros(t.ranks_per_node * n + 1)
        out[t.local_rank * n : (t.local_rank + 1) * n] = payload[:n]
        out[-1] = payload[-1]
        return out

    def _wire(self, dtype: torch.dtype, lossy: bool) -> torch.dtype:
        """What a tensor of ``dtype`` is sent in: :attr:`wire` where ``lossy`` and ``dtype``
        is wider than 16 bits, else ``dtype`` itself (a 16-bit gradient is sent as it is)."""
        if lossy and self.wire is not None and dtype.itemsize > 2:
            return self.wire
        return dtype

    def scatter(
        self, flat: Tensor, *, lossy: bool = False, step: int | None = None
    ) -> Arrival[Tensor]:
        """Start reducing this rank's chunk of the node's mean of ``flat`` (stage 1): the
        arrival is a new tensor of :meth:`Topology.chunk` elements in ``flat``'s dtype (the
        padding past ``flat``'s end is zeros; a ``flat`` already of :meth:`Topology.padded`
        elements, zeros past the unit's end, is sent uncopied). ``lossy``: sent in
        :attr:`wire` where that is a 16-bit dtype narrower than ``flat``'s (a compressed
        unit's gradient); else exact.
        ``flat`` must not change until it has arrived."""
        t = self.topology
        size, n = t.padded(flat.numel()), flat.numel()
        wire = self._wire(flat.dtype, lossy)
        if self.shared is not None:
            try:
                return self.shared.scatter(flat, size, wire, step)
            except SharedMemoryError as exc:
                self._unshare(exc)
        flat = flat.reshape(-1)
        if wire != flat.dtype:  # divided first: float16 overflows only where the mean would
            sent = torch.zeros(size, dtype=wire, device=flat.device)
            torch.mul(flat, 1.0 / t.ranks_per_node, out=sent[:n])
            pieces = self.node.all_to_all_async(sent, name="a unit's node sum", step=step)
            return pieces.map(lambda got: got.view(t.ranks_per_node, -1).sum(0, dtype=flat.dtype))
        sent = flat
        if size != n:
            sent = torch.zeros(size, dtype=flat.dtype, device=flat.device)
            sent[:n] = flat
        summed = self.node.reduce_scatter_async(sent, name="a unit's node sum", step=step)
        return summed.map(lambda chunk: chunk.div_(t.ranks_per_node))

    def gather(
        self, chunk: Tensor, numel: int, *, lossy: bool = False, step: int | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Every chunk of the node's aggregate, end to end (stage 3): a new flat tensor of
        ``numel`` elements in ``chunk``'s dtype (a view that cuts off the padding), and what
        rounding ``chunk`` to :attr:`wire` took from it (``chunk - round(chunk)``; ``None``:
        sent exactly). ``lossy`` as for :meth:`scatter`."""
        t = self.topology
        wire = self._wire(chunk.dtype, lossy)
        sent = chunk.reshape(-1).to(wire)
        rounded_off = None if wire == chunk.dtype else chunk - sent.to(chunk.dtype)
        if self.shared is not None:
            try:
                return self.shared.gather(sent, numel, chunk.dtype, step), rounded_off
            except SharedMemoryError as exc:
                self._unshare(exc)
        out = torch.empty(sent.numel() * t.ranks_per_node, dtype=wire, device=chunk.device)
        self.node.all_gather_into(out, sent, name="the node's aggregate", step=step)
        return out[:numel].to(chunk.dtype), rounded_off

    def spread(self, chunk: Tensor, numel: int) -> Tensor:
        """``chunk`` (a residual of this rank's chunk, in node-mean units) as a gradient of
        the whole unit that stage 1 turns back into it: ``L * chunk`` at its place, zeros
        elsewhere (the node's mean divides by ``L``)."""
        start, end = self.topology.bounds(numel)
        out = torch.zeros(numel, dtype=chunk.dtype, device=chunk.device)
        out[start:end] = chunk.reshape(-1)[: end - start] * self.topology.ranks_per_node
        return out
