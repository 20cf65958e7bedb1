"""Nonzero share of Top-k's error-feedback residuals over 30 training steps of vgg-digits (one
worker, static CFs 10, 100, 1000), and what a residual kept sparse (a float32 value and an int32
position per nonzero) would take against the dense one: ``python scripts/residual_density.py``
(``docs/studies/2026-12-04-error-feedback-o-k.md``)."""

from __future__ import annotations

import torch

from gravac import GravacOptimizer
from gravac.memory import ResidualMemory
from gravac_lab.compare import workloads

#: the steps after which the residuals are counted
COUNTED = (1, 10, 30)


def shares(cf: float) -> list[str]:
    """Per counted step: the residuals' nonzero share and a sparse residual's bytes over the
    dense one's (8 bytes a nonzero against 4 an element)."""
    w = workloads.get("vgg-digits")
    x, y, _, _ = w.data()
    torch.manual_seed(0)
    model = w.model()
    sgd = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=0.9)
    opt = GravacOptimizer(sgd, compressor="topk", policy="fixed", policy_options={"cf": cf})
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(1, max(COUNTED) + 1):
        idx = torch.randint(0, len(y), (32,), generator=gen)
        opt.zero_grad()
        w.loss(model(x[idx]), y[idx]).backward()
        opt.step()
        if step in COUNTED:
            assert isinstance(opt.memory, ResidualMemory)  # Top-k's error feedback
            es = list(opt.memory.residuals.values())
            nonzero = sum(int((e != 0).sum()) for e in es) / sum(e.numel() for e in es)
            out.append(f"step {step}: {nonzero:.4f} nonzero, sparse/dense {2 * nonzero:.2f}")
    return out


if __name__ == "__main__":
    for cf in (10.0, 100.0, 1000.0):
        print(f"CF {cf:g}: " + "; ".join(shares(cf)))
