"""The CPU selection paths (sampled threshold, chunked NumPy threshold pass) against their
torch references over everything."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.kernels.sparse import (
    magnitude_scan,
    threshold_indices,
    threshold_indices_reference,
    topk_indices,
    topk_indices_reference,
)

#: torch.topk's sizes (below 2^15), the threshold's below 2^16 (above it argpartition is the
#: threshold's fallback), and larger ones
SIZES = [2048, 40_000, 2**16, 100_003, 2**20 + 7]
FRACTIONS = [1 / 8, 1 / 10, 1 / 100, 1 / 1000, 1e-5]


def _inputs(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    if kind == "normal":
        x = torch.randn(n, generator=gen)
    elif kind == "heavy":  # a few huge entries, the rest small
        x = torch.randn(n, generator=gen) ** 5
    elif kind == "sparse":  # mostly zeros
        x = torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.02)
    elif kind == "rows":  # structure along a power-of-two row length
        x = torch.randn(n // 64 + 1, 1, generator=gen).expand(-1, 64).reshape(-1)[:n].clone()
        x += 1e-3 * torch.randn(n, generator=gen)
    else:
        raise ValueError(kind)
    return x.to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("kind", ["normal", "heavy", "sparse", "rows"])
def test_threshold_top_k_selects_the_k_largest(n: int, fraction: float, kind: str) -> None:
    x = _inputs(kind, n, torch.float32)
    k = max(1, round(n * fraction))
    got = topk_indices(x, k, backend="torch")
    want = topk_indices_reference(x, k)
    assert got.numel() == k == got.unique().numel()
    # the same magnitudes (the same set, ties aside)
    assert torch.equal(x[got].abs().sort().values, x[want].abs().sort().values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_threshold_top_k_in_other_dtypes(dtype: torch.dtype) -> None:
    x = _inputs("normal", 2**18, dtype)
    k = 2**18 // 100
    got, want = topk_indices(x, k, backend="torch"), topk_indices_reference(x, k)
    assert torch.equal(x[got].abs().sort().values, x[want].abs().sort().values)


@pytest.mark.parametrize("n", [3000, 40_000, 2**18])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries_are_selected_first(bad: float, n: int) -> None:
    x = torch.randn(n)
    x[[5, n - 7]] = bad
    got = set(topk_indices(x, n // 1000, backend="torch").tolist())
    assert {5, n - 7} <= got


def test_finite_values_whose_sum_overflows_still_select_exactly() -> None:
    x = torch.randn(2**17)
    x[:10] = 3e38
    got = topk_indices(x, 50, backend="torch")
    want = topk_indices_reference(x, 50)
    assert torch.equal(x[got].abs().sort().values, x[want].abs().sort().values)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
@pytest.mark.parametrize("n", [0, 1, 1000, 2**18 + 3])
def test_threshold_indices_equal_the_reference(dtype: torch.dtype, n: int) -> None:
    x = _inputs("heavy", max(n, 1), torch.float32)[:n].to(dtype)
    if n > 10:
        x[[3, 7, 9]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    for t in [0.0, 0.1, 1.0, 1e3, math.inf, math.nan]:
        got, want = threshold_indices(x, t, backend="torch"), threshold_indices_reference(x, t)
        assert got.dtype == torch.int64 and torch.equal(got, want), t


@pytest.mark.parametrize("kind", ["normal", "heavy", "rows"])
@pytest.mark.parametrize("fraction", [1 / 10, 1 / 100, 1e-4])
def test_magnitude_scan_keeps_a_superset_of_the_largest(kind: str, fraction: float) -> None:
    x = _inputs(kind, 2**20 + 7, torch.float32)
    count = max(1, round(x.numel() * fraction))
    scan = magnitude_scan(x, count)
    assert scan is not None
    idx = scan.indices
    assert idx.dtype == torch.int64 and bool((idx[1:] > idx[:-1]).all())  # ascending, distinct
    assert torch.equal(idx, threshold_indices_reference(x, scan.threshold))  # all at or above t
    assert torch.equal(scan.magnitudes, x[idx].abs())
    assert idx.numel() >= count
    top = topk_indices_reference(x, count)
    assert float(x[top].abs().min()) >= scan.threshold  # so the count largest are all in it
    mag = x.abs().double()
    assert scan.mean == pytest.approx(float(mag.mean()), rel=1e-5)
    assert scan.peak == float(mag.max())


def test_magnitude_scan_keeps_nan_and_reports_it() -> None:
    x = _inputs("normal", 2**18, torch.float32)
    x[[11, 2**17]] = math.nan
    scan = magnitude_scan(x, 100)
    assert scan is not None and {11, 2**17} <= set(scan.indices.tolist())
    assert math.isnan(scan.mean) and math.isnan(scan.peak)


def test_magnitude_scan_declines_what_it_cannot_scan() -> None:
    x = _inputs("normal", 2**18, torch.float32)
    assert magnitude_scan(x, x.numel() // 2) is None  # too large a fraction
    assert magnitude_scan(x[:1000], 10) is None  # small: the exact path is as fast
    assert magnitude_scan(x.to(torch.bfloat16), 100) is None  # no NumPy dtype
    assert magnitude_scan(x.view(2, -1).t().reshape(-1)[::2], 100) is None  # not contiguous
    assert magnitude_scan(torch.zeros(2**18), 100) is None  # no positive threshold
