"""The benchmarks' inputs and NMSE (no timing assertions: timing is the benchmark's)."""

from __future__ import annotations

import pytest
import torch

from gravac_lab.bench import common

SIZE = 4096


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16M", 16 * 2**20),
        ("512K", 512 * 2**10),
        ("1G", 2**30),
        ("4k", 4096),
        ("1000", 1000),
        (" 7 ", 7),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert common.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "0K", "-1", "1.5M", "16MB", "M", "abc", "1T", "1e6"])
def test_parse_size_rejects_bad_values_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--size") as info:
        common.parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("size", [1, 3, 100, 4096, 12345, 2**20 + 17])
def test_model_layout_fills_the_bucket(size: int) -> None:
    layout = common.model_layout(size)
    assert sum(s.numel() for s in layout) == size
    assert all(s.numel() > 0 for s in layout)


def test_model_layout_is_a_stack_of_matrices() -> None:
    layout = common.model_layout(16 * 2**20)
    matrices = [s for s in layout if len(s) == 2]
    assert len(matrices) >= common.MIN_MATRICES
    assert matrices[0] == torch.Size((512, 2048))
    assert matrices[1] == torch.Size((2048, 512))


def test_synthetic_gradients_are_seeded_heavy_tailed_and_correlated() -> None:
    a = common.synthetic_gradients(SIZE, 3, seed=1)
    b = common.synthetic_gradients(SIZE, 3, seed=1)
    c = common.synthetic_gradients(SIZE, 3, seed=2)
    assert len(a) == 3
    assert all(g.shape == (SIZE,) and g.dtype == torch.float32 for g in a)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])
    # Workers share a component: positively correlated, far from identical.
    corr = torch.corrcoef(torch.stack(a))[0, 1]
    assert 0.2 < float(corr) < 0.9
    # Heavy tails: kurtosis well above a Gaussian's 3.
    z = (a[0] - a[0].mean()) / a[0].std()
    assert float(z.pow(4).mean()) > 6.0


def test_synthetic_gradients_subnormal_tail() -> None:
    """The last ``subnormal`` fraction is the same draw times 2^-130, most of it subnormal."""
    plain = common.synthetic_gradients(SIZE, 2, seed=1)
    tiny = common.synthetic_gradients(SIZE, 2, seed=1, subnormal=0.25)
    cut = SIZE - SIZE // 4
    for p, t in zip(plain, tiny, strict=True):
        assert torch.equal(p[:cut], t[:cut])
        assert torch.equal(t[cut:], p[cut:] * common.SUBNORMAL_SCALE)
        assert float((t[cut:].abs() < torch.finfo(torch.float32).tiny).float().mean()) > 0.9
    with pytest.raises(ValueError, match="subnormal must be a fraction in"):
        common.synthetic_gradients(SIZE, 2, subnormal=-0.1)


def test_nmse() -> None:
    truth = torch.tensor([3.0, 4.0])
    assert common.nmse(truth, truth) == 0.0
    assert common.nmse(torch.zeros(2), truth) == pytest.approx(1.0)
    assert common.nmse(torch.tensor([3.0, 3.0]), truth) == pytest.approx(1 / 25)
    assert common.nmse(truth, torch.zeros(2)) != common.nmse(truth, torch.zeros(2))  # NaN
