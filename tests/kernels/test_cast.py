"""The 16-bit scaled cast's torch reference (its CuPy kernel is tested in test_cupy.py)."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.kernels import scaled_cast


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_clamps_to_the_finite_range_and_keeps_nan(wire: torch.dtype) -> None:
    limit = torch.finfo(wire).max
    x = torch.tensor([math.inf, -math.inf, 1e38, math.nan, 3.0], dtype=torch.float64)
    out = scaled_cast(x, wire, divisor=1).double()
    big = min(limit, float(torch.tensor(1e38).to(wire)))
    assert out[:3].tolist() == [limit, -limit, big]
    assert math.isnan(out[3]) and out[4] == 3.0


def test_multiplies_by_the_rounded_reciprocal() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    out = scaled_cast(x, torch.bfloat16, divisor=3)
    expected = (x.float() * torch.tensor(1.0 / 3, dtype=torch.float32)).to(torch.bfloat16)
    assert torch.equal(out, expected)


def test_bad_options_name_the_value() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        scaled_cast(torch.ones(2), torch.float32)
    with pytest.raises(ValueError, match="divisor must be an int >= 1, got 0"):
        scaled_cast(torch.ones(2), torch.float16, divisor=0)


def test_explicit_cupy_without_cuda_raises() -> None:
    with pytest.raises(RuntimeError, match="cupy"):
        scaled_cast(torch.ones(2), torch.float16, backend="cupy")
