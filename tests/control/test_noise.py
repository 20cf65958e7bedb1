"""The signal share of a window's gradient over ranks (gravac.control.noise)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gravac.control.noise import (
    SIGNAL_STRIDE,
    signal_fraction,
    signal_gain,
    signal_payload,
    signal_sample,
)


def summed(xs: list[torch.Tensor]) -> torch.Tensor:
    """What the all-reduce of every rank's payload gives."""
    return torch.stack([signal_payload([signal_sample(x)]) for x in xs]).sum(dim=0)


def test_the_payload_is_every_strided_element_then_its_energy() -> None:
    a, b = torch.arange(10.0), torch.arange(7.0)
    got = signal_payload([signal_sample(a), signal_sample(b)])
    x = torch.cat([a[::SIGNAL_STRIDE], b[::SIGNAL_STRIDE]])
    assert torch.equal(got[:-1], x)
    assert got[-1] == pytest.approx(float(x @ x), rel=1e-6) and got.dtype == torch.float32


def test_ranks_that_agree_are_all_signal_and_opposite_ones_none() -> None:
    x = torch.randn(4096)
    assert signal_fraction(summed([x, x]), 2) == pytest.approx(1.0)
    assert signal_fraction(summed([x, x, x, x]), 4) == pytest.approx(1.0)
    assert signal_fraction(summed([x, -x]), 2) == 0.0  # -1 before clipping


@settings(max_examples=20, deadline=None)
@given(
    share=st.floats(0.05, 0.95),
    ranks=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_it_estimates_the_share_of_the_energy_that_the_ranks_have_in_common(
    share: float, ranks: int, seed: int
) -> None:
    """Each rank's sum is one common vector plus noise of its own, the common part ``share``
    of a rank's expected energy: over 2^18 sampled elements the estimate is within 0.03."""
    gen = torch.Generator().manual_seed(seed)
    n = (1 << 18) * SIGNAL_STRIDE
    common = torch.randn(n, generator=gen, dtype=torch.float64) * share**0.5
    xs = [common + torch.randn(n, generator=gen, dtype=torch.float64) * (1 - share) ** 0.5]
    xs += [
        common + torch.randn(n, generator=gen, dtype=torch.float64) * (1 - share) ** 0.5
        for _ in range(ranks - 1)
    ]
    got = signal_fraction(summed(xs), ranks)
    assert got is not None and abs(got - share) < 0.03


def test_one_rank_a_zero_gradient_or_sums_not_finite_have_no_share() -> None:
    x = torch.randn(64)
    assert signal_fraction(summed([x]), 1) is None
    assert signal_fraction(summed([torch.zeros(64), torch.zeros(64)]), 2) is None
    for bad in (math.nan, math.inf):
        y = x.clone()
        y[SIGNAL_STRIDE] = bad  # a sampled element
        assert signal_fraction(summed([x, y]), 2) is None
    big = torch.full((64,), 3e38)  # finite on each rank, its sum over ranks overflows
    assert signal_fraction(summed([big, big]), 2) is None


def test_the_held_back_part_of_a_gain_counts_by_its_share_of_signal() -> None:
    assert signal_gain(0.3, 1.0) == pytest.approx(0.3)  # all signal: the gain itself
    assert signal_gain(0.3, 0.0) == 1.0  # all noise: nothing of worth held back
    assert signal_gain(0.3, 0.5) == pytest.approx(0.65)
