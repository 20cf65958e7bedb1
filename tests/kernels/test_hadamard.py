"""Fast Walsh-Hadamard transform: full and partial, against the dense Kronecker formulas."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.kernels.hadamard import fwht, fwht_rows, is_power_of_two, next_power_of_two

# float64 round-off of log2(n) butterfly stages on unit-scale data stays far below this.
F64_TOL = 1e-12
# float32: about log2(n) roundings of the running sums, n up to 2^14.
F32_TOL = 1e-5


def _sylvester(n: int) -> torch.Tensor:
    """Dense Sylvester-Hadamard matrix H_n (entries +-1), by the recursive definition."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 128])
def test_full_equals_dense_matrix(n: int) -> None:
    x = torch.randn(3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    expected = x @ _sylvester(n).T / math.sqrt(n)
    torch.testing.assert_close(fwht(x), expected, rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("n", [2, 8, 16, 64])
def test_partial_equals_kronecker_formula(n: int) -> None:
    """fwht(x, stages=t) == (H_{2^t} (x) I_{n/2^t}) x / 2^(t/2), for every t."""
    x = torch.randn(2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    for t in range(int(math.log2(n)) + 1):
        k = torch.kron(_sylvester(2**t), torch.eye(n // 2**t, dtype=torch.float64))
        expected = x @ k.T / math.sqrt(2**t)
        torch.testing.assert_close(fwht(x, stages=t), expected, rtol=0, atol=F64_TOL)


def test_block_rows_equal_identity_kronecker() -> None:
    """Full transforms of the rows of x.view(n/B, B) are (I_{n/B} (x) H_B) x / sqrt(B)."""
    n, block = 64, 8
    x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    k = torch.kron(torch.eye(n // block, dtype=torch.float64), _sylvester(block))
    expected = k @ x / math.sqrt(block)
    torch.testing.assert_close(fwht(x.view(-1, block)).reshape(-1), expected, rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("n", [1, 2, 1024, 2**14])
@pytest.mark.parametrize("stages", [None, 0, 1])
def test_self_inverse_and_orthonormal(n: int, stages: int | None) -> None:
    if stages is not None:
        stages = min(stages, n.bit_length() - 1)  # length 1 has no stage to run
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=gen)
    y = fwht(x, stages=stages)
    torch.testing.assert_close(fwht(y, stages=stages), x, rtol=0, atol=F32_TOL)
    assert float(y.norm()) == pytest.approx(float(x.norm()), rel=F32_TOL)
    x64 = x.double()
    torch.testing.assert_close(
        fwht(fwht(x64, stages=stages), stages=stages), x64, rtol=0, atol=F64_TOL
    )


def test_input_untouched_and_batch_shape_kept() -> None:
    x = torch.randn(2, 3, 16)
    before = x.clone()
    y = fwht(x)
    assert torch.equal(x, before)
    assert y.shape == x.shape
    torch.testing.assert_close(y[1, 2], fwht(x[1, 2]), rtol=0, atol=0)
    assert fwht(torch.empty(0, 8)).shape == (0, 8)


def test_non_contiguous_input() -> None:
    x = torch.randn(16, 4).t()  # rows of 16, non-contiguous
    torch.testing.assert_close(fwht(x), fwht(x.contiguous()), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("x", "stages", "match"),
    [
        (torch.randn(12), None, "power-of-two"),
        (torch.randn(8), 4, "stages"),
        (torch.randn(8), -1, "stages"),
        (torch.ones(8, dtype=torch.int64), None, "floating-point"),
        (torch.tensor(1.0), None, "scalar"),
    ],
)
def test_bad_arguments_raise(x: torch.Tensor, stages: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fwht(x, stages=stages)


def test_backend_selection() -> None:
    with pytest.raises(ValueError, match="backend"):
        fwht(torch.randn(4), backend="opencl")
    with pytest.raises(RuntimeError, match="cupy"):
        fwht(torch.randn(4), backend="cupy")  # CPU tensor, and no CuPy kernel yet
    assert fwht(torch.randn(4), backend="torch").shape == (4,)


def test_power_of_two_helpers() -> None:
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 5, 1024, 1025)] == [
        1,
        1,
        2,
        4,
        8,
        1024,
        2048,
    ]
    assert [is_power_of_two(n) for n in (0, 1, 2, 3, 64, 96)] == [
        False,
        True,
        True,
        False,
        True,
        False,
    ]


@pytest.mark.parametrize("width", [1, 2, 32, 64, 1024, 2**13, 2**16])
@pytest.mark.parametrize("in_place", [False, True])
def test_fwht_rows_equals_the_butterflies(width: int, in_place: bool) -> None:
    """The Kronecker-GEMM transform equals the reference butterflies to float rounding."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
    work = torch.empty_like(x)
    out = x.clone() if in_place else torch.empty_like(x)
    got = fwht_rows(out if in_place else x, out=out, work=work)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, fwht(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two width"):
        fwht_rows(torch.zeros(2, 3), out=torch.zeros(2, 3), work=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="work must match"):
        fwht_rows(x, out=out, work=torch.empty(1))
