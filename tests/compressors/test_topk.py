"""Top-k."""

from __future__ import annotations

import math

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, k_for_cf, wire_bytes
from gravac.gain import compression_gain


def test_equals_torch_topk_reference() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 40)
    c = compressors.create("topk")
    payload, ctx = c.compress(x, 20.0, Round())
    out = c.decompress(payload, ctx)
    k = 100
    ref = torch.zeros(2000)
    idx = torch.topk(x.abs().reshape(-1), k).indices
    ref[idx] = x.reshape(-1)[idx]
    assert torch.equal(out, ref.view(50, 40))
    assert ctx.achieved_cf == 20.0
    assert wire_bytes(payload) == k * (4 + 4)  # float32 values + int32 indices


@pytest.mark.parametrize("numel", [1, 2, 9, 1000, 12345])
@pytest.mark.parametrize("cf", [1.0, 1.5, 10.0, 1e6])
def test_keeps_exactly_k(numel: int, cf: float) -> None:
    x = torch.randn(numel)
    payload, ctx = compressors.create("topk").compress(x, cf, Round())
    k = k_for_cf(numel, cf)
    assert payload.values.numel() == payload.indices.numel() == k  # type: ignore[attr-defined]
    assert ctx.achieved_cf == numel / k


def test_gain_is_the_kept_energy_fraction() -> None:
    torch.manual_seed(1)
    x = torch.randn(10_000)
    c = compressors.create("topk")
    out = c.decompress(*c.compress(x, 10.0, Round()))
    kept = torch.topk(x.abs(), 1000).values.double().square().sum()
    assert compression_gain(x, out) == pytest.approx(float(kept / x.double().square().sum()))


@pytest.mark.parametrize(("cf1", "cf2"), [(2.0, 10.0), (10.0, 100.0), (10.0, 1000.0)])
def test_multilevel_equals_direct(cf1: float, cf2: float) -> None:
    torch.manual_seed(2)
    x = torch.randn(20_000)  # continuous values: no ties
    c = compressors.create("topk")
    p1, ctx1 = c.compress(x, cf1, Round())
    via = c.decompress(*c.recompress(p1, ctx1, cf2, Round()))
    direct = c.decompress(*c.compress(x, cf2, Round()))
    assert torch.equal(via, direct)


def test_nonfinite_values_are_sent_first() -> None:
    x = torch.randn(1000)
    x[3], x[500], x[999] = math.nan, math.inf, -math.inf
    c = compressors.create("topk")
    payload, _ = c.compress(x, 100.0, Round())  # k = 10
    assert {3, 500, 999} <= set(payload.indices.tolist())  # type: ignore[attr-defined]


def test_unknown_backend_raises() -> None:
    with pytest.raises(ValueError, match="backend"):
        compressors.create("topk", backend="opencl")
