"""none / fp16 / bf16."""

from __future__ import annotations

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, wire_bytes
from gravac.compressors.base import sum_payloads
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


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_jump_beyond_the_lagged_scale_is_clamped_so_the_sum_stays_finite(name: str) -> None:
    """With the previous step's maximum (1), a step of 1e6 on every rank: each value is clamped
    to M / (2 N), so the 16-bit sum of N of them is finite and within the stated bound, and
    what the clamp kept from the wire stays in x - D(payload) (the residual)."""
    n = 8
    c = compressors.create(name)
    rnd = Round(world_size=n, agreed=torch.ones(1), stale=True)
    x = torch.full((16,), 1e6)
    compressed = [c.compress(x, 1.0, rnd) for _ in range(n)]
    ctx = compressed[0][1]
    total = sum_payloads([p for p, _ in compressed])
    assert torch.isfinite(total.values.float()).all()  # type: ignore[attr-defined]
    mean = c.combine_mean([total], ctx, n)
    bound = c.mean_bound(ctx, n, 1e6)
    assert bound is not None and float(mean.abs().max()) <= bound
    assert float(mean.max()) < 1e6
    residual = c.residual_(x.clone(), compressed[0][0], ctx)
    torch.testing.assert_close(residual + c.decompress(*compressed[0]), x)


@pytest.mark.parametrize(("name", "rtol"), [("fp16", 2**-11), ("bf16", 2**-8)])
def test_values_beyond_the_range_are_scaled_not_clamped(name: str, rtol: float) -> None:
    """A power-of-two scale from the agreed maximum: values up to 1e6 (above fp16's 65504), and
    the same values scaled anywhere in float32's normal range (1e-43 below fp16's smallest
    subnormal, 1e32 above its largest value) arrive to the format's relative precision (a
    shift capped at +-64 sent those times 1e-30 as zeros, and clamped those times 1e32)."""
    x = torch.tensor([1e6, -1e6, 3e3, 777.0, 12345.678])
    for scale in (1.0, 1e-15, 1e-30, 1e-36, 1e-43, 1e20, 1e32):
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


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_payloads_and_results_held_by_the_caller_are_never_overwritten(name: str) -> None:
    """The compressor reuses its buffers across steps, but only those nobody holds any more."""
    c = compressors.create(name)
    gen = torch.Generator().manual_seed(3)
    held = []
    for step in range(4):
        x = torch.randn(5000, generator=gen)
        payload, ctx = c.compress(x, 1.0, Round(step=step))
        out = c.decompress(payload, ctx)
        held.append((payload.values.clone(), payload, out.clone(), out))  # type: ignore[attr-defined]
        c.compress(torch.randn(5000, generator=gen), 1.0, Round(step=step))  # dropped at once
    for values, payload, decompressed, out in held:
        assert torch.equal(payload.values, values) and torch.equal(out, decompressed)


@pytest.mark.parametrize(("name", "wire"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_combine_sums_in_sixteen_bits_then_scales(
    name: str, wire: torch.dtype, dtype: torch.dtype
) -> None:
    """combine() is the reference: the payloads summed in order in the wire dtype (what the
    all-reduce computes), widened to the input's dtype, times the context's scale; the
    payloads are left as they were (bf16 values of a bf16 gradient included)."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(3000, generator=gen).to(dtype) for _ in range(3)]
    c = compressors.create(name)
    rnd = Round(world_size=3, agreed=torch.stack([g.abs().max() for g in grads]).max().float())
    sent = [c.compress(g, 1.0, rnd) for g in grads]
    kept = [p.values.clone() for p, _ in sent]  # type: ignore[attr-defined]
    out = c.combine([p for p, _ in sent], sent[0][1])
    total = sum((p.values for p, _ in sent[1:]), sent[0][0].values)  # type: ignore[attr-defined]
    expected = total.to(dtype) * torch.tensor(sent[0][1].scale, dtype=dtype)  # type: ignore[attr-defined]
    assert out.dtype == dtype and torch.equal(out, expected)
    assert all(torch.equal(p.values, k) for (p, _), k in zip(sent, kept, strict=True))  # type: ignore[attr-defined]
    assert all(p.values.dtype == wire for p, _ in sent)  # type: ignore[attr-defined]
