"""The 16-bit scaled cast, its inverse and the residual update: the chunked CPU passes against
the whole-tensor torch references (the CuPy kernel is tested in test_cupy.py)."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.kernels import scaled_cast
from gravac.kernels.cast import (
    CAST_CHUNK,
    scaled_cast_reference,
    scaled_widen,
    scaled_widen_reference,
    sub_scaled_,
    sub_scaled_reference,
)

WIRES = [torch.float16, torch.bfloat16]
#: Lengths around the chunk: within one chunk, exactly two, and two plus a ragged tail.
LENGTHS = [1000, 2 * CAST_CHUNK, 2 * CAST_CHUNK + 4099]


def _gradient(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Magnitudes over 2^+-40 (beyond fp16's range both ways) with signed zeros, +-Inf and NaN
    at fixed places."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-40, 41, (n,), generator=gen).double())
    x[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e30], dtype=torch.float64)
    return x.to(dtype)


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


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("source", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("divisor", "exponent"), [(1, 0), (3, 0), (4, 20), (7, -9)])
def test_chunked_cast_is_bit_identical_to_the_reference(
    wire: torch.dtype, n: int, source: torch.dtype, divisor: int, exponent: int
) -> None:
    x = _gradient(n, source)
    expected = scaled_cast_reference(x, wire, divisor=divisor, exponent=exponent)
    out = scaled_cast(x, wire, divisor=divisor, exponent=exponent, backend="torch")
    assert out.dtype == wire
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # NaN bits included


def test_cast_writes_into_out_and_checks_it() -> None:
    x = _gradient(3000)
    out = torch.empty(3000, dtype=torch.float16)
    assert scaled_cast(x, torch.float16, divisor=2, out=out) is out
    assert torch.equal(
        out.view(torch.int16), scaled_cast_reference(x, torch.float16, divisor=2).view(torch.int16)
    )
    with pytest.raises(ValueError, match=r"out must be a contiguous flat torch\.float16 tensor"):
        scaled_cast(x, torch.float16, out=torch.empty(2999, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be a contiguous flat"):
        scaled_cast(x, torch.float16, out=torch.empty(6000, dtype=torch.float16)[::2])


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("target", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 3])
def test_chunked_widen_is_bit_identical_to_the_reference(
    wire: torch.dtype, n: int, target: torch.dtype, count: int
) -> None:
    values = [scaled_cast(_gradient(n, seed=i), wire, divisor=count) for i in range(count)]
    kept = [v.clone() for v in values]
    scale = math.ldexp(3.0, -5)
    out = torch.empty(n, dtype=target)
    assert scaled_widen(values, scale, out) is out
    expected = scaled_widen_reference(values, scale, target)
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))
    assert torch.equal(out.isnan(), expected.isnan())
    assert all(
        torch.equal(v.view(torch.int16), k.view(torch.int16))
        for v, k in zip(values, kept, strict=True)
    )


def test_widen_needs_values() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        scaled_widen([], 1.0, torch.empty(0))


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("target", [torch.float32, torch.float64])
def test_chunked_residual_update_is_bit_identical_to_the_reference(
    wire: torch.dtype, n: int, target: torch.dtype
) -> None:
    x = torch.randn(n, dtype=target, generator=torch.Generator().manual_seed(1))
    values = scaled_cast(x, wire, divisor=3, exponent=2)
    scale = math.ldexp(3.0, -2)
    expected = sub_scaled_reference(x.clone(), values, scale)
    out = x.clone()
    assert sub_scaled_(out, values, scale) is out
    assert torch.equal(out, expected)
    strided = torch.randn(2 * n, dtype=target, generator=torch.Generator().manual_seed(2))
    a, b = strided.clone()[::2], strided.clone()[::2]  # not contiguous: the reference's path
    assert torch.equal(sub_scaled_(a, values, scale), sub_scaled_reference(b, values, scale))
