"""What the ranks' aggregate keeps of a window against what each rank keeps, at 2 and 4 ranks.

The search by shadow judges a CF by the window gain of each rank's own send, summed term by term
over the ranks (:mod:`gravac.control.window`). At 4 workers it judged static CF 160 at 0.92 of
CF 10's gain while CF 160 needed 0.78 of the steps' progress, and at 2 workers 0.89-0.94 where
it made 0.96-0.97 (``docs/studies/2026-12-07-judged-progress.md``). This asks whether the
aggregate's window gain sees the difference: in one process, ``W`` simulated ranks train the
workload as ``gravac compare``'s ``gravac`` mode does (each its own shard and batches, SGD with
momentum at the workload's rate, the model's matrices Top-k over one flat unit under error
feedback, the 1-D tensors dense, the mean of what the ranks send as the step's gradient), and
at the end of every window of ``--window`` steps it takes, with ``S_r`` what rank ``r`` sent over
the window and ``X_r = S_r + e_r`` what it had to send::

    per-rank gain  = (sum_r <S_r, X_r>)^2 / (sum_r ||S_r||^2  sum_r ||X_r||^2)
    aggregate gain = <S, X>^2 / (||S||^2 ||X||^2),  S = sum_r S_r,  X = sum_r X_r

over every element (no sample). It prints, per ranks and CF, the median steps to ``--bar``
(evaluated every 10 steps, held twice, as the scoreboard does) and the median of each gain
over the windows before the fewest steps of any CF at those ranks. Not the engine: no buckets,
no overlap, no search; the CFs are static.

(``docs/studies/2026-12-07-judged-progress.md``)::

    python scripts/aggregate_gain.py --ranks 2,4 --cfs 10,160 --seeds 0,1,2,3,4,5
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from gravac.gain import gain_from_terms, gain_terms
from gravac_lab.compare import workloads
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.train import MODEL_SEED, STOP_HOLD, batch_generator, shard

__all__ = ["Run", "gains", "main", "train"]

#: steps between evaluations, as the scoreboard's
EVAL_EVERY = 10


class Run(NamedTuple):
    """One simulated run: its steps to the bar (``None``: not reached) and, per window's end
    (the step), the per-rank and the aggregate gains."""

    steps_to_bar: int | None
    windows: list[tuple[int, float, float]]


def gains(sent: Sequence[Tensor], totals: Sequence[Tensor]) -> tuple[float, float]:
    """The per-rank and the aggregate window gains of the ranks' ``sent`` (``S_r``) and
    ``totals`` (``X_r``), flat (see the module docstring; :func:`gravac.gain.gain_from_terms`:
    1 where ``X`` is zero)."""
    own = torch.stack([gain_terms(x, s) for s, x in zip(sent, totals, strict=True)]).sum(0)
    whole = gain_terms(torch.stack(list(totals)).sum(0), torch.stack(list(sent)).sum(0))
    return gain_from_terms(own), gain_from_terms(whole)


def _topk(x: Tensor, cf: float) -> Tensor:
    """``x`` with all but its ``numel / cf`` largest magnitudes zeroed."""
    k = max(1, int(x.numel() / cf))
    kept = torch.zeros_like(x)
    index = x.abs().topk(k, sorted=False).indices
    return kept.index_copy_(0, index, x.index_select(0, index))


def train(
    workload_name: str, ranks: int, cf: float, seed: int, steps: int, bar: float, window: int
) -> Run:
    """Train ``ranks`` simulated ranks at a static ``cf`` until the bar is held or ``steps``."""
    workload, cfg = workloads.get(workload_name), CompareConfig(workload=workload_name)
    train_x, train_y, test_x, test_y = workload.data()
    shards = [shard(train_x, train_y, r, ranks) for r in range(ranks)]
    torch.manual_seed(MODEL_SEED + seed)
    model = workload.model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr_value, momentum=cfg.momentum)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    gens = [batch_generator(seed, r) for r in range(ranks)]
    numel = sum(p.numel() for p in matrices)
    residuals = [torch.zeros(numel) for _ in range(ranks)]
    window_sent = [torch.zeros(numel) for _ in range(ranks)]
    windows: list[tuple[int, float, float]] = []
    held = 0
    for step in range(1, steps + 1):
        sent, dense = [], []
        for r, (x, y) in enumerate(shards):
            idx = torch.randint(0, len(y), (cfg.batch_size,), generator=gens[r])
            model.zero_grad(set_to_none=True)
            workload.loss(model(x[idx]), y[idx]).backward()
            g = torch.cat([p.grad.reshape(-1) for p in matrices])  # type: ignore[union-attr]
            total = g + residuals[r]
            c = _topk(total, cf)
            residuals[r] = total - c
            window_sent[r] += c
            sent.append(c)
            dense.append([p.grad.clone() for p in vectors])  # type: ignore[union-attr]
        mean = torch.stack(sent).mean(0)
        for p, part in zip(matrices, mean.split([p.numel() for p in matrices]), strict=True):
            p.grad = part.view_as(p).clone()
        for i, p in enumerate(vectors):
            p.grad = torch.stack([d[i] for d in dense]).mean(0)
        opt.step()
        if step % window == 0:
            totals = [s + e for s, e in zip(window_sent, residuals, strict=True)]
            windows.append((step, *gains(window_sent, totals)))
            window_sent = [torch.zeros(numel) for _ in range(ranks)]
        if step % EVAL_EVERY == 0:
            held = held + 1 if workload.reached(workload.metric(model, test_x, test_y), bar) else 0
            if held >= STOP_HOLD:
                return Run(step - EVAL_EVERY * (STOP_HOLD - 1), windows)
    return Run(None, windows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="vgg-digits")
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--cfs", default="10,160", help="comma-separated static CFs")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--bar", type=float, default=0.9705)
    parser.add_argument("--window", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| ranks | CF | steps to the bar | progress | per-rank gain | aggregate gain |")
    print("|--:|--:|--:|--:|--:|--:|")
    for ranks in (int(r) for r in args.ranks.split(",")):
        runs = {
            float(cf): [
                train(args.workload, ranks, float(cf), s, args.steps, args.bar, args.window)
                for s in seeds
            ]
            for cf in args.cfs.split(",")
        }
        steps = {
            cf: statistics.median(r.steps_to_bar or args.steps for r in rs)
            for cf, rs in runs.items()
        }
        fewest = min(steps.values())
        for cf, rs in runs.items():
            early = [w for r in rs for w in r.windows if w[0] <= fewest]
            own = statistics.median(w[1] for w in early) if early else math.nan
            agg = statistics.median(w[2] for w in early) if early else math.nan
            print(f"| {ranks} | {cf:g} | {steps[cf]:g} | {fewest / steps[cf]:.2f} | "
                  f"{own:.3f} | {agg:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
