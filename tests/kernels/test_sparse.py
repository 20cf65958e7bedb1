"""The torch top-k paths: the sampled-threshold selection against torch.topk over everything."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.kernels.sparse import topk_indices, topk_indices_reference

SIZES = [2**16, 100_003, 2**20 + 7]
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


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries_are_selected_first(bad: float) -> None:
    x = torch.randn(2**18)
    x[[5, 70_000]] = bad
    got = set(topk_indices(x, 100, backend="torch").tolist())
    assert {5, 70_000} <= got


def test_finite_values_whose_sum_overflows_still_select_exactly() -> None:
    x = torch.randn(2**17)
    x[:10] = 3e38
    got = topk_indices(x, 50, backend="torch")
    want = topk_indices_reference(x, 50)
    assert torch.equal(x[got].abs().sort().values, x[want].abs().sort().values)
