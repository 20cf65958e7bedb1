"""Two-level aggregation's node stage (stages 1 and 3) over gloo against shared memory.

Each of ``--nodes`` emulated nodes of 2 ranks (one process a rank, one torch thread each, all on
this machine) runs :class:`gravac.hierarchy.Hierarchy`'s node stage on a gradient of ``--numel``
float32 elements, ``--repeats`` times each way, and rank 0 prints the median seconds of a
stage 1 (the node's mean, each rank's chunk of it) and a stage 3 (every chunk to every rank):

- collective: ``node_stage="collective"``, the node group's reduce-scatter and all-gather
  (gloo, over TCP on loopback);
- shm: ``node_stage="shm"``, through files in ``/dev/shm`` that the node's ranks map
  (:mod:`gravac.shm`). Checked equal to the collectives', bit for bit.

``gravac.shm`` unlinks the files as soon as every rank of a node has mapped them::

    python scripts/node_stage_probe.py --nodes 2 --numel 5324426
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gravac.hierarchy import Hierarchy, Topology

__all__ = ["node_stage"]

#: Ranks a node on the test bed (issue 36's 2 x 2).
RANKS_PER_NODE = 2


def node_stage(rank: int, world: int, port: int, numel: int, repeats: int) -> None:
    """One rank of the probe (see the module docstring)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    topology = Topology(world, RANKS_PER_NODE, rank)
    ways = {stage: Hierarchy(topology, stage=stage) for stage in ("collective", "shm")}
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {way: [] for way in ways}
    for step in range(repeats):
        wholes = {}
        for way, hierarchy in ways.items():
            dist.barrier()
            start = time.perf_counter()
            hierarchy.begin_step()
            chunk = hierarchy.scatter(grad, step=step).wait()
            wholes[way], _ = hierarchy.gather(chunk, numel, step=step)
            times[way].append(time.perf_counter() - start)
        if not torch.equal(wholes["shm"], wholes["collective"]):
            raise AssertionError("the shared-memory node stage differs from gloo's")
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
    mp.spawn(node_stage, args=(world, args.port, args.numel, args.repeats), nprocs=world)


if __name__ == "__main__":
    main()
