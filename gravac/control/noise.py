"""How much of a window's gradient is signal, from how its sums on the ranks agree.

Over a window, rank ``r`` had everything there was to send ``X_r`` (:mod:`gravac.control.window`:
the window's error-fed gradients). Each is one expected sum ``G`` plus the rank's own noise
``N_r``, from its own batches, independent across ranks. Over ``W`` ranks::

    E ||sum_r X_r||^2 = W^2 ||G||^2 + W E||N||^2        E sum_r ||X_r||^2 = W ||G||^2 + W E||N||^2

so ::

    f = (||sum_r X_r||^2 - sum_r ||X_r||^2) / ((W - 1) sum_r ||X_r||^2)

estimates ``||G||^2 / (||G||^2 + E||N||^2)``, the share of one rank's window gradient that is
signal: the two-batch-size estimate of the gradient noise scale (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", appendix A), with one rank's batches and all ranks'
as the two sizes. Noise averages out of the sum, signal adds up; a negative estimate is noise
larger than the signal (clipped to 0).

Why the search by shadow reads it: the window gain counts everything error feedback held back
against a CF, noise or signal, yet held-back noise costs no progress, and on the studies' CNNs
most of a window's gradient is noise after the first 50 steps
(``docs/studies/2026-12-02-signal-share.md``). So the search judges a CF by the signal it held
back, the held-back share of the energy ``1 - g`` times the largest signal share measured so
far in the run (:func:`signal_gain`): the workload's at its start, where it learns fastest. Not
the current share: late in training on the LSTM it falls as on the CNNs, yet higher CFs there
still cost perplexity.

The sums are taken on a sample, every :data:`SIGNAL_STRIDE`-th element of the window's sample
(:func:`gravac.control.window.sample`), and added over ranks by one all-reduce at each window's end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["SIGNAL_STRIDE", "signal_fraction", "signal_gain", "signal_payload", "signal_sample"]

#: every SIGNAL_STRIDE-th element of the window's sample (itself 1/16 of the gradient) is
#: summed over ranks: 1/64 of the gradient once a window, 330 KB on the VGG-style CNN (27 ms
#: at 100 Mbit/s, 1 ms a step of a 25-step window); the share is a ratio of energies over
#: 83,000 such elements there
SIGNAL_STRIDE = 4


def signal_sample(total: Tensor) -> Tensor:
    """The elements of one tensor's sampled window sum ``X`` (``total``, flat) that one rank
    adds to the all-reduce: every :data:`SIGNAL_STRIDE`-th, float32, in a tensor of their own
    (held until the window's all-reduce: a quarter of ``X``)."""
    return total.reshape(-1)[::SIGNAL_STRIDE].float().contiguous()


def signal_payload(samples: Sequence[Tensor]) -> Tensor:
    """What one rank adds to the all-reduce, float32: the :func:`signal_sample` of each of its
    window's sampled ``X``, then their energy ``||x||^2`` (summed in float64: the share is a
    difference of two such energies), written into one new tensor."""
    n = sum(t.numel() for t in samples)
    payload = torch.empty(n + 1, dtype=torch.float32, device=samples[0].device)
    x = torch.cat(list(samples), out=payload[:n])
    payload[n] = _energy(x).float()
    return payload


def _energy(x: Tensor) -> Tensor:
    """``||x||^2`` summed in float64, from one float64 copy of ``x`` (freed on return)."""
    wide = x.double()
    return wide @ wide


def signal_fraction(summed: Tensor, ranks: int) -> float | None:
    """The signal share ``f`` of the module docstring from the all-reduced
    :func:`signal_payload` (``summed``, over ``ranks`` ranks), clipped to ``[0, 1]``; ``None``
    with one rank, or when the window's gradient is zero or its sums are not finite (no share
    to estimate)."""
    own = float(summed[-1])
    if ranks < 2 or not 0 < own < math.inf:
        return None
    total = summed[:-1].double()
    f = (float(total @ total) - own) / ((ranks - 1) * own)
    return min(1.0, max(0.0, f)) if math.isfinite(f) else None


def signal_gain(gain: float, share: float) -> float:
    """A window gain ``g`` with what it held back counted by its ``share`` of signal:
    ``1 - (1 - g) * share`` (``share = 1``: the gain itself)."""
    return 1.0 - (1.0 - gain) * share
