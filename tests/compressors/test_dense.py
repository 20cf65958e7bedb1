"""none / fp16 / bf16."""

from __future__ import annotations

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, wire_bytes
from gravac.gain import compression_gain
from gravac.simulation import simulate


def test_none_is_exact_with_gain_one() -> None:
    x = torch.randn(100, 3)
    c = compressors.create("none")
    out = c.decompress(*c.compress(x, 1.0, Round()))
    assert torch.equal(out, x)
    assert compression_gain(x, out) == 1.0


@pytest.mark.parametrize(("name", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_casts_send_two_bytes_per_element(name: str, dtype: torch.dtype) -> None:
    x = torch.randn(1000)
    payload, ctx = compressors.create(name).compress(x, 1.0, Round())
    assert wire_bytes(payload) == 2000
    assert ctx.achieved_cf == 2.0
    assert payload.values.dtype == dtype  # type: ignore[attr-defined]


def test_fp16_sum_of_many_workers_does_not_overflow() -> None:
    """Pre-division by N keeps the all-reduced fp16 sum finite at the largest fp16 inputs."""
    n = 64
    grads = [torch.full((10,), 60000.0) for _ in range(n)]
    res = simulate(compressors.create("fp16"), grads, 2.0)
    assert torch.isfinite(res.mean).all()
    torch.testing.assert_close(res.mean, torch.full((10,), 60000.0), rtol=1e-2, atol=0)


@pytest.mark.parametrize(("name", "rtol"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_values_beyond_the_range_are_scaled_not_clamped(name: str, rtol: float) -> None:
    """A power-of-two scale from the agreed maximum: values up to 1e6 (above fp16's 65504), and
    the same values times 1e-15 (below its smallest subnormal), arrive to the format's relative
    precision."""
    x = torch.tensor([1e6, -1e6, 3e3, 777.0, 12345.678])
    for scale in (1.0, 1e-15):
        c = compressors.create(name)
        xs = x * scale
        sent = c.decompress(*c.compress(xs, 1.0, Round()))
        torch.testing.assert_close(sent, xs, rtol=rtol, atol=0)


def test_the_scale_is_agreed_across_ranks() -> None:
    """Two ranks of very different magnitudes: the mean arrives finite and accurate."""
    grads = [torch.full((8,), 5e5), torch.full((8,), -1e5)]
    res = simulate(compressors.create("fp16"), grads, 2.0)
    torch.testing.assert_close(res.mean, torch.full((8,), 2e5), rtol=2**-10, atol=0)


def test_many_ranks_need_the_agreed_maximum() -> None:
    with pytest.raises(ValueError, match=r"needs rnd\.agreed"):
        compressors.create("fp16").compress(torch.ones(3), 1.0, Round(world_size=2))
