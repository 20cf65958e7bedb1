"""The search by shadow's tables at each decision: what it estimated, and so what it chose.

Trains a workload of ``gravac compare`` (2 ranks over gloo on loopback, one torch thread each,
its seed's initial weights and batches, an evaluation every 10 steps as a compare run pauses
for one) under the default search for ``--steps`` steps, and prints at each window's end
(rank 0): the CF the next window sends; the step time the search estimates for every CF of its
ladder (:meth:`gravac.control.searches.shadow.ShadowController.estimated_tsys`) and the times
it measured; the top's time from the warm-up; the judged gains; and each CF's compression
throughput over the best (``docs/studies/2026-12-07-warmup-trajectory.md``)::

    python scripts/shadow_decisions.py --workload vgg-digits --seeds 0,1,2,3,4,5,6,7
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gravac import GravacConfig, GravacOptimizer
from gravac.control.searches.shadow import ShadowController
from gravac_lab.compare import workloads
from gravac_lab.compare.modes import broadcast_parameters
from gravac_lab.compare.train import MODEL_SEED, batch_generator, shard

__all__ = ["decisions"]

#: ranks, each its own process
WORLD = 2
#: samples a rank trains on a step (gravac compare's default)
BATCH = 32
#: steps between the evaluations that pause training, as gravac compare's default
EVAL_EVERY = 10
_PORT = 29700


def _row(values: dict[float, float]) -> str:
    return ", ".join(f"{cf:g}: {v:.3g}" for cf, v in sorted(values.items()))


def _tables(c: ShadowController) -> str:
    """One decision's line: the next CF, estimated and measured ms a step, the top's, the
    judged gains and the throughputs over the best."""
    ms = 1e3 * BATCH * WORLD
    estimated = {cf: ms / t for cf in c.ladder if (t := c.estimated_tsys(cf))}
    measured = {cf: ms / t for cf, t in c.windows.smoothed.tsys.items()}
    judged = {cf: g for cf in c.ladder if (g := c.judged_gain(cf)) is not None}
    tput = c.shadow_tput()
    best = max(tput.values(), default=1.0)
    top = "-" if c.top_seconds is None else f"{c.top_seconds * ms:.1f}"
    return (
        f"next {c.windows.current:g}; estimated ms {{{_row(estimated)}}}; "
        f"measured ms {{{_row(measured)}}}; the top's ms {top}; judged {{{_row(judged)}}}; "
        f"tput / best {{{_row({cf: t / best for cf, t in tput.items()})}}}"
    )


def decisions(rank: int, workload: str, seed: int, steps: int, out: Any) -> None:
    """Train ``steps`` steps on this rank and put rank 0's lines on the queue ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_PORT + seed))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    w = workloads.get(workload)
    train_x, train_y, test_x, test_y = w.data()
    train_x, train_y = shard(train_x, train_y, rank, WORLD)
    torch.manual_seed(MODEL_SEED + seed)
    model = w.model()
    broadcast_parameters(model)
    sgd = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9)
    opt = GravacOptimizer(sgd, GravacConfig(compressor="topk", batch_size=BATCH))
    if not isinstance(opt.controller, ShadowController):
        raise TypeError(f"the default search is not the search by shadow: {opt.controller!r}")
    gen = batch_generator(seed, rank)
    closed, lines = 0, []
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(train_y), (BATCH,), generator=gen)
        opt.zero_grad(set_to_none=True)
        w.loss(model(train_x[idx]), train_y[idx]).backward()
        opt.step()
        if opt.controller.windows_closed != closed:
            closed = opt.controller.windows_closed
            lines.append(f"seed {seed} step {step}: {_tables(opt.controller)}")
        if step % EVAL_EVERY == 0:
            if rank == 0:
                w.metric(model, test_x, test_y)
            dist.barrier()
    if rank == 0:
        out.put(lines)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--workload", default="vgg-digits", choices=workloads.names())
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--steps", type=int, default=65, help="steps a seed (default 65)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for seed in (int(s) for s in args.seeds.split(",")):
        out = ctx.Queue()
        procs = [
            ctx.Process(target=decisions, args=(r, args.workload, seed, args.steps, out))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        print("\n".join(out.get()), flush=True)
        for p in procs:
            p.join()


if __name__ == "__main__":
    main()
