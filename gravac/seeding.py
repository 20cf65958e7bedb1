"""Shared randomness: seeds that every rank derives identically from values they all agree on.

Random-k indices, DGC's threshold sample, THC's Rademacher diagonal and PowerSGD's start vectors
come from :func:`generator` seeded by :func:`derive_seed` of (user seed, step, bucket key, ...),
never from the global RNG, so every replica draws the same numbers without touching user state
(the approach of PyTorch's PowerSGD hook).
"""

from __future__ import annotations

import torch

__all__ = ["derive_seed", "generator"]

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
# OOPSLA 2014): a bijective 64-bit mixer, so distinct inputs give unrelated seeds.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: torch.Generator.manual_seed takes seeds below 2^63.
_SEED_BITS = 63


def _splitmix64(z: int) -> int:
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def derive_seed(*parts: int) -> int:
    """A seed in ``[0, 2^63)`` mixing the integers ``parts`` (order matters)."""
    z = 0
    for p in parts:
        z = _splitmix64(z ^ (int(p) & _MASK64))
    return z >> (64 - _SEED_BITS)


def generator(device: torch.device | str, *parts: int) -> torch.Generator:
    """A fresh generator on ``device`` seeded with ``derive_seed(*parts)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(*parts))
    return gen
