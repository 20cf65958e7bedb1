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


def test_fp16_saturates_and_keeps_the_excess_in_the_residual() -> None:
    x = torch.tensor([1e6, -1e6, 1.0])
    c = compressors.create("fp16")
    sent = c.decompress(*c.compress(x, 1.0, Round()))
    assert torch.isfinite(sent).all()
    assert sent[0] == torch.finfo(torch.float16).max
    assert torch.equal(sent + (x - sent), x)
