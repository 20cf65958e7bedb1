"""THCCompressor: CF -> bits, wire bytes, transports, determinism, edge cases, options."""

from __future__ import annotations

import math

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, sum_payloads, wire_bytes
from gravac.compressors.base import Multilevel
from gravac.compressors.thc import (
    DEFAULT_GRANULARITY,
    THCContext,
    THCLevelsPayload,
    THCPackedPayload,
    bits_for_cf,
    lane_bits,
    unpack_lanes,
)
from gravac.compressors.thc.table import (
    optimal_table,
)
from gravac.simulation import simulate
from tests.compressors.thc.common import CF_B4, FULL_NMSE_BOUND, nmse


@pytest.mark.parametrize(
    ("cf", "bits"),
    [(1.0, 8), (3.9, 8), (4.0, 8), (7.99, 8), (8.0, 4), (15.9, 4), (16.0, 2), (32.0, 1), (1e4, 1)],
)
def test_cf_to_bits(cf: float, bits: int) -> None:
    assert bits_for_cf(cf) == bits
    c = compressors.create("thc", transport="allgather")
    payload, ctx = c.compress(torch.randn(4096), cf, Round())
    assert ctx.achieved_cf == 32 / bits
    assert wire_bytes(payload) == 4096 * bits // 8  # true 32/b compression upstream


def test_wire_bytes_of_both_transports() -> None:
    x = torch.randn(5000)  # padded to 8192 by the full rotation
    ag, _ = compressors.create("thc", rotation="full", transport="allgather").compress(
        x, CF_B4, Round()
    )
    assert isinstance(ag, THCPackedPayload) and ag.indices.dtype == torch.uint8
    assert wire_bytes(ag) == 8192 // 2
    norm = x.norm().reshape(1)
    c4 = compressors.create("thc", bits=4, rotation="full")
    ar, ctx = c4.compress(x, CF_B4, Round(world_size=8, agreed=norm))
    assert isinstance(ar, THCLevelsPayload) and ar.words.dtype == torch.int64
    # 30 * 8 = 240 needs 8 bits: 8 lanes a word, 1024 words, plus the count word.
    assert wire_bytes(ar) == 8 * (8192 // 8 + 1)
    assert ctx.achieved_cf == c4.deliverable_cf(CF_B4, 8) == 4.0
    ar9, ctx9 = c4.compress(x, CF_B4, Round(world_size=9, agreed=norm))
    # 30 * 9 = 270 needs 9 bits: 7 lanes a word (1 bit unused), ceil(8192 / 7) words.
    assert wire_bytes(ar9) == 8 * (-(-8192 // 7) + 1)
    assert ctx9.achieved_cf == 32 * 7 / 64
    # With b chosen from the CF: the most precise b whose wire CF is the largest not above 8.
    auto = compressors.create("thc", rotation="full")
    _, ctx = auto.compress(x, CF_B4, Round(world_size=9, agreed=norm))
    assert ctx.bits == 1 and ctx.achieved_cf == auto.deliverable_cf(CF_B4, 9) == 32 * 16 / 64


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_the_wire_cf_promised_is_the_one_the_payload_sends(bits: int) -> None:
    """For each width b and N = 2, 8, 64 ranks (the compressor's docstring table): the CF the
    controller is promised is the one the compression reports and the one its payload's bytes
    give (but for the payload's count word), and the lanes are just wide enough to hold the
    sum of N ranks' levels."""
    x = torch.randn(2**16)  # a power of 2: the full rotation adds no padding
    norm = x.norm().reshape(1)
    c = compressors.create("thc", bits=bits, rotation="full")
    for n in (2, 8, 64):
        cf = c.deliverable_cf(4.0, n)
        payload, ctx = c.compress(x, 4.0, Round(world_size=n, agreed=norm))
        assert ctx.bits == bits and ctx.achieved_cf == cf
        # words are whole: up to one lane-word's rounding over 2^16 elements
        assert 4 * x.numel() / (wire_bytes(payload) - 8) == pytest.approx(cf, rel=1e-3)
        width = lane_bits(DEFAULT_GRANULARITY[bits], n)
        assert 2 ** (width - 1) <= DEFAULT_GRANULARITY[bits] * n < 2**width


@pytest.mark.parametrize("rotation", ["full", "partial"])
def test_transports_give_the_same_estimate(rotation: str) -> None:
    gen = torch.Generator().manual_seed(15)
    grads = [torch.randn(3000, generator=gen) for _ in range(5)]
    # bits fixed: with 5 ranks the all-reduce would pick b = 2 (its lanes' best wire CF <= 8).
    ar = simulate(compressors.create("thc", bits=4, rotation=rotation), grads, CF_B4, step=4)
    ag = simulate(
        compressors.create("thc", bits=4, rotation=rotation, transport="allgather"),
        grads,
        CF_B4,
        step=4,
    )
    torch.testing.assert_close(ar.mean, ag.mean, rtol=1e-6, atol=1e-6)
    for s_ar, s_ag in zip(ar.sent, ag.sent, strict=True):
        torch.testing.assert_close(s_ar, s_ag, rtol=1e-6, atol=1e-6)


def test_allreduce_combine_of_one_reduced_payload_knows_the_count() -> None:
    """A payload summed by a real all-reduce decompresses alone (its count lane says N)."""
    c = compressors.create("thc")
    gen = torch.Generator().manual_seed(16)
    xs = [torch.randn(500, generator=gen) for _ in range(3)]
    rnd0 = Round(step=1, world_size=3)
    stats = torch.stack([c.local_stats(x, CF_B4, rnd0) for x in xs]).amax(0)  # type: ignore[misc]
    rnd = Round(step=1, world_size=3, agreed=stats)
    compressed = [c.compress(x, CF_B4, rnd) for x in xs]
    reduced = sum_payloads([p for p, _ in compressed])
    expected = sum(c.decompress(p, ctx) for p, ctx in compressed)
    assert isinstance(expected, torch.Tensor)
    torch.testing.assert_close(c.combine([reduced], compressed[0][1]), expected, rtol=0, atol=1e-5)


def test_shared_diagonal_and_data_keyed_rounding() -> None:
    x = torch.randn(2048, generator=torch.Generator().manual_seed(17))
    a, b = compressors.create("thc", seed=5), compressors.create("thc", seed=5)
    pa, ca = a.compress(x, CF_B4, Round(step=2, key=1))
    pb, cb = b.compress(x, CF_B4, Round(step=2, key=1))
    assert isinstance(ca, THCContext) and isinstance(cb, THCContext)
    assert torch.equal(ca.signs, cb.signs)  # every rank draws the same diagonal
    assert torch.equal(pa.words, pb.words)  # type: ignore[attr-defined]  # same data
    for other in (Round(step=3, key=1), Round(step=2, key=2)):
        po, co = a.compress(x, CF_B4, other)
        assert not torch.equal(co.signs, ca.signs)  # type: ignore[attr-defined]
        assert not torch.equal(po.words, pa.words)  # type: ignore[attr-defined]
    _, cc = compressors.create("thc", seed=6).compress(x, CF_B4, Round(step=2, key=1))
    assert not torch.equal(cc.signs, ca.signs)  # type: ignore[attr-defined]
    # Workers whose inputs differ round independently: as often apart as two independent
    # roundings of the same values (about 1/3 of the coordinates for uniform positions).
    # (Inputs a few ulps apart can give bit-identical rotated values, which round alike.)
    near = x + 1e-4 * torch.randn(2048, generator=torch.Generator().manual_seed(170))
    pn, _ = a.compress(near, CF_B4, Round(step=2, key=1, agreed=ca.norms))
    levels = [
        unpack_lanes(p.words, ca.lane_bits, ca.padded)  # type: ignore[attr-defined]
        for p in (pn, pa)
    ]
    differ = float((levels[0] != levels[1]).float().mean())
    assert 0.25 < differ < 0.45


@pytest.mark.parametrize("rotation", ["full", "partial"])
@pytest.mark.parametrize("transport", ["allreduce", "allgather"])
@pytest.mark.parametrize("shape", [(), (1,), (2,), (3, 5), (1025,)])
def test_small_shapes_and_layout(rotation: str, transport: str, shape: tuple[int, ...]) -> None:
    c = compressors.create("thc", rotation=rotation, transport=transport)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(18))
    res = simulate(c, [x, 2 * x], CF_B4)
    assert res.mean.shape == x.shape and torch.isfinite(res.mean).all()
    block, padded = c.layout(x.numel())  # type: ignore[attr-defined]
    assert padded % block == 0 and padded >= x.numel()
    if rotation == "partial":
        assert block <= 1024 and padded - x.numel() < block


def test_zero_input_decompresses_to_exact_zero() -> None:
    c = compressors.create("thc")
    x = torch.zeros(100)
    out = c.decompress(*c.compress(x, CF_B4, Round()))
    assert torch.equal(out, x)
    # One worker at zero among others: fine, the others' estimate is unaffected in scale.
    res = simulate(c, [x, torch.randn(100)], CF_B4)
    assert torch.isfinite(res.mean).all()


@pytest.mark.parametrize("rotation", ["full", "partial"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_gives_non_finite_output(rotation: str, bad: float) -> None:
    c = compressors.create("thc", rotation=rotation)
    x = torch.randn(3000)
    x[5] = bad
    norms = c.local_stats(x, CF_B4, Round())
    assert norms is not None and not torch.isfinite(norms).all()
    out = c.decompress(*c.compress(x, CF_B4, Round(agreed=norms)))
    assert not torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(19)).to(dtype)
    c = compressors.create("thc")
    payload, ctx = c.compress(x, CF_B4, Round())
    out = c.decompress(payload, ctx)
    assert out.dtype == dtype
    assert isinstance(ctx, THCContext)
    assert ctx.signs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert nmse(out, x) <= FULL_NMSE_BOUND


def test_missing_or_wrong_agreed_stats_raise() -> None:
    c = compressors.create("thc", rotation="partial")
    x = torch.randn(4096)
    with pytest.raises(ValueError, match=r"rnd\.agreed"):
        c.compress(x, CF_B4, Round(world_size=2))
    with pytest.raises(ValueError, match="4 block norms"):
        c.compress(x, CF_B4, Round(agreed=torch.ones(3)))


def test_options_are_registered() -> None:
    assert compressors.options("thc") == [
        "bits",
        "granularity",
        "p",
        "rotation",
        "partial_stages",
        "transport",
        "seed",
        "symmetric_table",
        "backend",
    ]
    c = compressors.create("thc", transport="allgather")
    assert (
        c.collective == "allgather" and not isinstance(c, Multilevel) and c.stats_rule.op == "max"
    )
    assert "transport='allgather'" in repr(c)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"bits": 3}, r"bits must be one of \[1, 2, 4, 8\] or None, got 3"),
        ({"bits": 16}, r"bits .* got 16"),
        ({"bits": 4, "granularity": 14}, r"granularity must be >= 2\^bits - 1 = 15 .* got 14"),
        ({"granularity": 40}, r"granularity .* 255 for bits=8 .* got 40"),
        ({"granularity": 2.5}, r"granularity must be an int or None, got 2.5"),
        ({"p": 0.0}, r"p \(the clamped fraction\) must be in \(0, 1\) or None, got 0.0"),
        ({"p": 1.0}, r"p .* got 1.0"),
        ({"p": -0.1}, r"p .* got -0.1"),
        (
            {"transport": "ring"},
            r"transport must be one of \['allreduce', 'allgather'\], got 'ring'",
        ),
        ({"rotation": "half"}, r"rotation must be one of \['full', 'partial'\], got 'half'"),
        ({"partial_stages": 0}, r"partial_stages must be an int in \[1, 30\], got 0"),
        ({"partial_stages": 31}, r"partial_stages .* got 31"),
        ({"seed": "x"}, r"seed must be an int, got 'x'"),
        ({"symmetric_table": "yes"}, r"symmetric_table must be a bool, got 'yes'"),
        ({"backend": "opencl"}, r"backend must be one of"),
    ],
)
def test_bad_options_raise(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compressors.create("thc", **opts)


def test_explicit_bits_granularity_and_p_are_used() -> None:
    c = compressors.create("thc", bits=2, granularity=12, p=1 / 8, symmetric_table=False)
    assert c.config(1000.0) == (2, 12, 1 / 8)  # type: ignore[attr-defined]
    assert c.table(1000.0) == optimal_table(2, 12, 1 / 8)  # type: ignore[attr-defined]
    payload, ctx = c.compress(torch.randn(64), 1000.0, Round())
    assert ctx.achieved_cf == 8.0  # one rank: levels 0..12 in 4-bit lanes, 16 to a word
    levels = unpack_lanes(payload.words, ctx.lane_bits, ctx.padded)  # type: ignore[attr-defined]
    assert set(levels.tolist()) <= set(optimal_table(2, 12, 1 / 8))
