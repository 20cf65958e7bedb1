"""Gradient-like test inputs shared by the compressor tests."""

from __future__ import annotations

import math

import torch

#: input families: light and heavy tails, all-tied magnitudes, mostly exact zeros
KINDS = ["normal", "lognormal", "cauchy", "constant", "sparse"]


def gradient_like(kind: str, d: int, gen: torch.Generator) -> torch.Tensor:
    """``d`` float32 values of family ``kind`` (one of :data:`KINDS`)."""
    if kind == "normal":
        return torch.randn(d, generator=gen)
    if kind == "lognormal":  # heavy tails: magnitudes spread over many orders
        return torch.randn(d, generator=gen) * torch.exp(2 * torch.randn(d, generator=gen))
    if kind == "cauchy":
        return torch.tan(math.pi * (torch.rand(d, generator=gen) - 0.5))
    if kind == "constant":  # all magnitudes tie
        return torch.where(torch.rand(d, generator=gen) < 0.5, -0.25, 0.25)
    if kind == "sparse":  # mostly exact zeros, as embedding gradients
        return torch.randn(d, generator=gen) * (torch.rand(d, generator=gen) < 0.02)
    raise ValueError(f"unknown input kind {kind!r}; choose one of {KINDS}")
