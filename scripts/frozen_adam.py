"""Adam under compression with its second moment frozen after a dense warm-up (an experiment).

``docs/studies/2026-12-04-adam.md`` found lstm-text 5-13% above dense DDP's perplexity with
Adam under Top-k and error feedback, at every rate and CF tried, where SGD pays 0.8%. 1-bit Adam
(Tang et al. 2021) compresses only after a dense warm-up, from which Adam's second moment ``v``
is kept fixed: the compressed steps' bursts (error feedback delivers a held-back entry all at
once) then cannot inflate ``v``. This script asks whether that part alone closes the gap, with
gravac's optimizer front end unchanged: 2 gloo ranks on loopback train the lstm-text workload
(the batches and shards of ``gravac compare``), in one of these modes:

* ``dense``: gradients all-reduced (mean), then torch's Adam;
* ``gravac``: ``GravacOptimizer`` around torch's Adam from the first step;
* ``frozen``: ``dense`` for ``--warmup`` steps, then ``GravacOptimizer`` around
  :class:`FrozenAdam`, Adam with ``v`` (bias-corrected) fixed at the warm-up's last value;
* ``frozen-dense``: the same without compression (what freezing ``v`` costs by itself);
* ``precond``: as ``frozen``, but what gravac compresses (with its error feedback) is the
  gradient already divided by ``sqrt(v_hat) + eps`` (a hook before gravac's), and
  :class:`FrozenAdam` steps by its momentum alone: the same update as ``frozen`` without
  compression, while Top-k selects the entries that move the parameters most.

Each prints its final test perplexity (rank 0)::

    python scripts/frozen_adam.py --mode frozen --seed 0 --lr 6e-3
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import gravac
from gravac_lab.compare import workloads
from gravac_lab.compare.train import MODEL_SEED, batch_generator, shard

#: the modes of the module docstring
MODES = ("dense", "gravac", "frozen", "frozen-dense", "precond")


class FrozenAdam(torch.optim.Optimizer):
    """Adam whose bias-corrected second moment is a fixed tensor per parameter::

        m <- b1 m + (1 - b1) g;    p <- p - lr (m / (1 - b1^t)) / (sqrt(v_hat) + eps)

    with ``m`` and ``t`` taken over from an Adam that trained before (its state). With
    ``preconditioned``, the gradients it is given are ``g / (sqrt(v_hat) + eps)`` already
    (:attr:`scale` holds that factor): ``m`` is kept in those units and the step is
    ``lr m / (1 - b1^t)``, the same update.
    """

    def __init__(
        self, params: Iterable[Tensor], adam: torch.optim.Adam, *, preconditioned: bool = False
    ) -> None:
        group = adam.param_groups[0]
        super().__init__(params, {"lr": group["lr"], "betas": group["betas"], "eps": group["eps"]})
        b2, eps = group["betas"][1], group["eps"]
        self.preconditioned = preconditioned
        self.scale: dict[Tensor, Tensor] = {}
        for p in (p for g in self.param_groups for p in g["params"]):
            s = adam.state[p]
            t = int(s["step"])
            v_hat = s["exp_avg_sq"] / (1 - b2**t)
            self.scale[p] = 1.0 / (v_hat.sqrt() + eps)
            m = s["exp_avg"] * self.scale[p] if preconditioned else s["exp_avg"].clone()
            self.state[p] = {"m": m, "t": t, "v_hat": v_hat}

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, _ = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                s["t"] += 1
                s["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                m_hat = s["m"] / (1 - b1 ** s["t"])
                if self.preconditioned:
                    p.sub_(group["lr"] * m_hat)
                else:
                    p.sub_(group["lr"] * m_hat / (s["v_hat"].sqrt() + group["eps"]))


def _frozen(model: nn.Module, adam: torch.optim.Adam, *, preconditioned: bool) -> FrozenAdam:
    """:class:`FrozenAdam` taking over from ``adam``; ``preconditioned``: with hooks that
    divide each gradient by ``sqrt(v_hat) + eps`` as backward makes it (registered before
    gravac's, so they run first)."""
    frozen = FrozenAdam(model.parameters(), adam, preconditioned=preconditioned)
    if preconditioned:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q, w=frozen.scale[p]: _scale(q, w))
    return frozen


def _scale(p: Tensor, w: Tensor) -> None:
    assert p.grad is not None
    p.grad.mul_(w)


def _all_reduce_mean(model: nn.Module, world: int) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def _train(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    work = workloads.get("lstm-text")
    train_x, train_y, test_x, test_y = work.data()
    train_x, train_y = shard(train_x, train_y, rank, world)
    torch.manual_seed(MODEL_SEED + args.seed)
    model = work.model()
    adam = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = batch_generator(args.seed, rank)
    dense_steps = {"dense": args.steps, "gravac": 0}.get(args.mode, args.warmup)
    opt: Any = adam
    for step in range(1, args.steps + 1):
        if step == dense_steps + 1:
            inner: torch.optim.Optimizer = adam
            if args.mode != "gravac":
                inner = _frozen(model, adam, preconditioned=args.mode == "precond")
            opt = (
                inner
                if args.mode == "frozen-dense"
                else gravac.GravacOptimizer(inner, compressor="topk", batch_size=32)
            )
        b = torch.randint(0, len(train_y), (32,), generator=gen)
        opt.zero_grad(set_to_none=True)
        work.loss(model(train_x[b]), train_y[b]).backward()
        if step <= dense_steps or args.mode == "frozen-dense":
            _all_reduce_mean(model, world)
        opt.step()
    if rank == 0:
        print(
            f"{args.mode} seed {args.seed} lr {args.lr}: {work.metric(model, test_x, test_y):.4f}"
        )
    if isinstance(opt, gravac.GravacOptimizer):
        opt.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--port", type=int, default=29531)
    args = parser.parse_args()
    mp.spawn(_train, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
