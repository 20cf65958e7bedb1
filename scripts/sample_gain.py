"""How closely the search's block samples estimate a window gain, by sample size.

One ``Linear(8200, 8200)`` weight (67,240,000 elements) of a small MLP trained with SGD on
random inputs; for each CF, Top-k with error feedback on the whole weight, over windows of
:data:`WINDOW` steps. At each window's end the window gain (:mod:`gravac.control.window`) over
every element, and over the same sums sampled as gravac samples them (a block of 16 in every
16 x stride elements) at each of :data:`STRIDES`; printed: the relative error of each sampled
estimate (``docs/studies/2026-12-06-sample-budget.md``)::

    python scripts/sample_gain.py
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gravac.control.window import sample, window_terms
from gravac.gain import gain_from_terms
from gravac.kernels import topk_indices

WIDTH = 8200
CFS = (10.0, 160.0, 1000.0)
STRIDES = (16, 32, 64, 128, 256, 1024, 4096)
WINDOW = 3
WINDOWS = 4
BATCH = 32


def gain(sent: Tensor, residual: Tensor, stride: int | None = None) -> float:
    """The window gain of ``sent`` and ``residual``: over every element, or sampled."""
    if stride is not None:
        sent, residual = sample(sent, stride), sample(residual, stride)
    return gain_from_terms(window_terms(sent.double(), residual.double()))


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.ReLU(), nn.Linear(WIDTH, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    weight = model[0].weight
    n = weight.numel()
    residuals = {cf: torch.zeros(n) for cf in CFS}
    sent = {cf: torch.zeros(n) for cf in CFS}
    header = "".join(f"  1/{s} ({n // s / 1e6:.2f}M)" for s in STRIDES)
    print(f"one Linear({WIDTH}, {WIDTH}) weight ({n:,} elements), Top-k with error feedback,")
    print(f"windows of {WINDOW} steps, batch {BATCH}; relative error of the sampled window gain")
    print(f"window      CF  exact gain{header}")
    for step in range(WINDOW * WINDOWS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 10, (BATCH,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert weight.grad is not None
        g = weight.grad.detach().reshape(-1).clone()
        opt.step()
        for cf in CFS:
            xx = g + residuals[cf]
            kept = topk_indices(xx, max(1, round(n / cf)))
            send = torch.zeros_like(xx).index_copy_(0, kept, xx[kept])
            sent[cf] += send
            residuals[cf] = xx - send
        if (step + 1) % WINDOW:
            continue
        for cf in CFS:
            exact = gain(sent[cf], residuals[cf])
            errors = [gain(sent[cf], residuals[cf], s) / exact - 1 for s in STRIDES]
            widths = [len(f"  1/{s} ({n // s / 1e6:.2f}M)") for s in STRIDES]
            cells = "".join(f"{e:+.2e}".rjust(w) for e, w in zip(errors, widths, strict=True))
            print(f"{step // WINDOW:6d}  {cf:6.0f}  {exact:10.6f}{cells}")
            sent[cf].zero_()


if __name__ == "__main__":
    main()
