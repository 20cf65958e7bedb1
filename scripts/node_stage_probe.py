"""Two-level aggregation's node stage (stages 1 and 3) over gloo against shared memory.

Each of ``--nodes`` emulated nodes of 2 ranks (one process a rank, one torch thread each, all on
this machine) sums a gradient of ``--numel`` float32 elements between its ranks and gives every
rank the node's sum, ``--repeats`` times each way, and rank 0 prints the median seconds:

- gloo: ``reduce_scatter_tensor`` then ``all_gather_into_tensor`` on the node's group, what
  :class:`gravac.hierarchy.Hierarchy` runs (over TCP on loopback);
- shm: every rank copies its gradient into its slot of a file in ``/dev/shm`` mapped by the
  node's ranks, a node barrier, each rank sums its chunk over the slots into a shared result, a
  node barrier, every rank copies the result out. Checked equal to gloo's, bit for bit.

The files are unlinked as soon as every rank has mapped them::

    python scripts/node_stage_probe.py --nodes 2 --numel 5324426
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["node_stage"]

#: Ranks a node on the test bed (issue 36's 2 x 2).
RANKS_PER_NODE = 2


def _shared(path: str, numel: int, owner: bool, group: dist.ProcessGroup) -> torch.Tensor:
    """``numel`` float32 elements of ``path``, mapped shared by every rank of ``group``; the
    ``owner`` creates the file and unlinks it once all have mapped it."""
    if owner:
        with open(path, "wb") as f:
            f.truncate(4 * numel)
    dist.barrier(group=group)
    try:
        mem = torch.from_file(path, shared=True, size=numel, dtype=torch.float32)
        dist.barrier(group=group)
    finally:
        if owner and os.path.exists(path):
            os.unlink(path)
    return mem


def node_stage(rank: int, world: int, port: int, numel: int, repeats: int, tag: str) -> None:
    """One rank of the probe (see the module docstring)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    node, local = divmod(rank, RANKS_PER_NODE)
    groups = [
        dist.new_group(list(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)))
        for n in range(world // RANKS_PER_NODE)
    ]
    group = groups[node]
    chunk = -(-numel // RANKS_PER_NODE)
    padded = chunk * RANKS_PER_NODE
    grad = torch.zeros(padded)
    grad[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    mine, whole = torch.empty(chunk), torch.empty(padded)
    mem = _shared(f"/dev/shm/{tag}-{node}", padded * (RANKS_PER_NODE + 1), local == 0, group)
    slots = mem[: padded * RANKS_PER_NODE].view(RANKS_PER_NODE, padded)
    result = mem[padded * RANKS_PER_NODE :]
    own = slice(local * chunk, (local + 1) * chunk)
    times: dict[str, list[float]] = {"gloo": [], "shm": []}
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.reduce_scatter_tensor(mine, grad, group=group)
        dist.all_gather_into_tensor(whole, mine, group=group)
        times["gloo"].append(time.perf_counter() - start)
        reference = whole.clone()
        dist.barrier()
        start = time.perf_counter()
        slots[local].copy_(grad)
        dist.barrier(group=group)
        torch.sum(slots[:, own], dim=0, out=result[own])
        dist.barrier(group=group)
        whole.copy_(result)
        times["shm"].append(time.perf_counter() - start)
        if not torch.equal(whole, reference):
            raise AssertionError("the shared-memory sum differs from gloo's")
    if rank == 0:
        for way, seconds in times.items():
            print(f"{way}: median {1000 * statistics.median(seconds):.1f} ms over {repeats}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--numel", type=int, default=5_324_426, help="vgg-digits' parameters")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    world = args.nodes * RANKS_PER_NODE
    tag = f"gravac-node-stage-{uuid.uuid4().hex}"
    mp.spawn(node_stage, args=(world, args.port, args.numel, args.repeats, tag), nprocs=world)


if __name__ == "__main__":
    main()
