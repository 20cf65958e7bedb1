"""Fingerprints of deterministic gravac runs, to show that a refactoring changed no behaviour.

Each case trains the same small CNN on scikit-learn's digits with 2 gloo workers for a fixed
number of steps, through the optimizer or the DDP comm hook, with a counter clock (every call
one second later) so that the searches' timing-based decisions are deterministic too. It prints
one JSON line per case: the CFs sent at every step, the bytes sent, and a SHA-256 of the final
parameters (and of rank 1's, which must equal rank 0's); a case named ``...-decay`` drops the
learning rate 10x halfway (a step schedule). Run it on two trees and compare::

    PYTHONPATH=/path/to/old python scripts/equivalence.py > old.jsonl
    PYTHONPATH=/path/to/new python scripts/equivalence.py > new.jsonl
    cmp old.jsonl new.jsonl

It uses only the public API, which both trees must share.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: (name, front end, compressor, policy, policy options, compressor options)
CASES: tuple[tuple[str, str, str, str, dict[str, Any], dict[str, Any]], ...] = (
    ("topk-auto", "optimizer", "topk", "exponential", {}, {}),
    ("topk-auto-hook", "hook", "topk", "exponential", {}, {}),
    ("topk-trial", "optimizer", "topk", "geometric", {"search": "trial"}, {}),
    ("topk-paper", "optimizer", "topk", "exponential", {"search": "paper"}, {}),
    ("topk-accordion", "optimizer", "topk", "accordion", {"interval": 5}, {}),
    ("topk-accordion-decay", "optimizer", "topk", "accordion", {"interval": 5, "eta": 0.2}, {}),
    ("redsync-shadow-hook", "hook", "redsync", "exponential", {"search": "shadow"}, {}),
    ("dgc-fixed", "optimizer", "dgc", "fixed", {"cf": 100}, {}),
    ("thc-fixed", "optimizer", "thc", "fixed", {"cf": 16}, {}),
    ("thc-fixed-hook", "hook", "thc", "fixed", {"cf": 8}, {}),
    ("powersgd-auto", "optimizer", "powersgd", "exponential", {}, {}),
    ("randomk-fixed", "optimizer", "randomk", "fixed", {"cf": 10}, {}),
    ("fp16-fixed-hook", "hook", "fp16", "fixed", {"cf": 2}, {}),
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 64, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16, torch.tensor(y)


def _counter() -> Any:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def _worker(rank: int, port: int, steps: int, case: tuple[Any, ...], queue: Any) -> None:
    import gravac
    from gravac.ddp import GravacHookState, gravac_hook

    name, front, compressor, policy, policy_options, compressor_options = case
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    x, y = _digits()
    model = _model()
    options = {
        "compressor": compressor,
        "policy": policy,
        "policy_options": policy_options,
        "compressor_options": compressor_options,
        "window": 5,
        "warmup_steps": 3,
        "batch_size": 32,
        "clock": _counter(),
    }
    cfs: list[float] = []
    if front == "optimizer":
        opt = gravac.GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), **options)
        engine = opt.engine
        net: nn.Module = model
        sgd: torch.optim.Optimizer = opt
    else:
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        state = GravacHookState(None, **options)
        net.register_comm_hook(state, gravac_hook)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        engine = state.engine
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        if name.endswith("-decay") and step == steps // 2:  # a step schedule's 10x drop
            for group in sgd.param_groups:
                group["lr"] *= 0.1
        idx = torch.randint(0, len(y), (32,), generator=gen)
        sgd.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        sgd.step()
        record = engine.last_record
        cfs.append(float("nan") if record is None else round(record.cf_sent, 6))
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    queue.put(
        (
            rank,
            {
                "case": name,
                "cf_sent": cfs,
                "wire_bytes": engine.total_wire_bytes,
                "params": digest.hexdigest(),
            },
        )
    )
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    from gravac.launch import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--cases", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    wanted = set(args.cases.split(",")) - {""}
    ctx = mp.get_context("spawn")
    for case in CASES:
        if wanted and case[0] not in wanted:
            continue
        queue = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, port, args.steps, case, queue)) for r in (0, 1)
        ]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        if results[0]["params"] != results[1]["params"]:
            print(f"{case[0]}: the ranks' parameters differ", file=sys.stderr)
            return 1
        print(json.dumps(results[0], sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
