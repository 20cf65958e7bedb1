"""The two-level node stage's collectives on gloo, one 21 MB gradient (5.3M float32 elements):
stage 1 as a float32 reduce-scatter, a float16 reduce-scatter, and float16 pieces by all-to-all
summed by the owner in float32 (gravac's ``node_precision="fp16"``); stage 3 as a float32 and a
float16 all-gather. Median of 15, printed by rank 0 (``docs/studies/2026-12-04-two-level.md``)::

    torchrun --nproc-per-node 2 scripts/node_stage_bench.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

#: elements of the gradient: the VGG-style digits CNN's
ELEMENTS = 5_300_000
#: timed repetitions of each collective
REPEATS = 15


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    g = torch.randn(ELEMENTS)
    chunk = ELEMENTS // ranks

    def rs32() -> None:
        out = torch.empty(chunk)
        dist.reduce_scatter_tensor(out, g)
        out.div_(ranks)

    def rs16() -> None:
        out = torch.empty(chunk, dtype=torch.half)
        dist.reduce_scatter_tensor(out, (g * (1 / ranks)).half())
        out.float()

    def a2a16() -> None:
        sent = torch.empty(ELEMENTS, dtype=torch.half)
        torch.mul(g, 1 / ranks, out=sent)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent)
        got.view(ranks, -1).float().sum(0)

    def ag32() -> None:
        dist.all_gather_into_tensor(torch.empty(ELEMENTS), g[:chunk])

    def ag16() -> None:
        out = torch.empty(ELEMENTS, dtype=torch.half)
        dist.all_gather_into_tensor(out, g[:chunk].half())
        out.float()

    runs: list[Callable[[], None]] = [rs32, rs16, a2a16, ag32, ag16]
    for run in runs:
        seconds = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
        if dist.get_rank() == 0:
            print(f"{run.__name__}: {statistics.median(seconds) * 1000:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
