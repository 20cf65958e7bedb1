"""THC's all-reduce lanes: widths, packing, exact sums, overflow."""

from __future__ import annotations

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, sum_payloads
from gravac.compressors.thc import (
    LANE_WORD_BITS,
    THCLevelsPayload,
    lane_bits,
    lanes_per_word,
    pack_lanes,
    unpack_lanes,
)
from gravac.simulation import simulate
from tests.compressors.thc.common import CF_B4


def test_lane_bits_and_the_error_when_none_fits() -> None:
    assert [lane_bits(30, n) for n in (1, 2, 8, 9, 17)] == [5, 6, 8, 9, 9]
    assert lanes_per_word(8) == 8 and lanes_per_word(9) == 7 and LANE_WORD_BITS == 64
    assert lane_bits(1, 2**64 - 1) == 64
    with pytest.raises(ValueError, match=r"world_size=4.*granularity=4611686018427387904"):
        lane_bits(2**62, 4)


@pytest.mark.parametrize("width", [1, 3, 7, 8, 11, 32, 64])
@pytest.mark.parametrize("numel", [0, 1, 5, 63, 1000, 4097])
def test_pack_lanes_round_trip(width: int, numel: int) -> None:
    gen = torch.Generator().manual_seed(width * 7919 + numel)
    top = min(2**width, 2**62)
    levels = torch.randint(0, top, (numel,), generator=gen)
    if width == LANE_WORD_BITS and numel:
        levels[0] = -1  # all 64 bits set: the two's complement pattern of 2^64 - 1
    words = pack_lanes(levels, width)
    assert words.dtype == torch.int64 and words.numel() == -(-numel // lanes_per_word(width))
    assert torch.equal(unpack_lanes(words, width, numel), levels)


@pytest.mark.parametrize("g", [1, 3, 30, 510])
@pytest.mark.parametrize("numel", [0, 1, 17, 1001])
def test_summed_words_unpack_to_the_lane_sums(g: int, numel: int) -> None:
    """N ranks' words summed (wrapping past the sign bit) unpack to the elementwise sum, up to
    the largest N a 64-bit lane holds and at the clamp (every level g)."""
    gen = torch.Generator().manual_seed(g + numel)
    for n in (1, 2, 3, 8, 9, 64, 257):
        width = lane_bits(g, n)
        ranks = [torch.randint(0, g + 1, (numel,), generator=gen) for _ in range(n)]
        ranks[0] = torch.full((numel,), g)
        total = pack_lanes(ranks[0], width)
        for r in ranks[1:]:
            total += pack_lanes(r, width)
        assert torch.equal(unpack_lanes(total, width, numel), torch.stack(ranks).sum(0))


def test_no_lane_overflow_at_the_clamp_for_many_workers() -> None:
    """Every worker at the clamp (all levels g) through sum_payloads: exact for 2..1024."""
    for g in (1, 30, 510):
        for n in (2, 9, 255, 256, 1024):
            c = compressors.create("thc", bits=4 if g == 30 else (1 if g == 1 else 8))
            width = lane_bits(g, n)
            words = pack_lanes(torch.full((16,), g), width)
            one = THCLevelsPayload(words=words, count=torch.ones(1, dtype=torch.int64))
            total = sum_payloads([one] * n)
            assert isinstance(total, THCLevelsPayload) and int(total.count) == n
            assert torch.equal(unpack_lanes(total.words, width, 16), torch.full((16,), g * n))
            assert c.deliverable_cf(1.0, n) == 32 * lanes_per_word(width) / 64


def test_clamped_inputs_sum_exactly_at_256_workers() -> None:
    """A real round where most coordinates sit at the clamp, 256 workers, no wrap-around."""
    c = compressors.create("thc", rotation="partial", partial_stages=1)  # blocks of 2 elements
    x = torch.tensor([1.0, 1.0] * 8)  # rotated blocks (sqrt2, 0): scaled to 1.41, 0
    res = simulate(c, [x] * 256, CF_B4)
    assert torch.isfinite(res.mean).all()
    torch.testing.assert_close(res.mean, res.sent[0], rtol=0, atol=1e-6)  # identical inputs


def test_combine_refuses_more_payloads_than_the_lanes_hold() -> None:
    c = compressors.create("thc")
    x = torch.randn(64)
    p, ctx = c.compress(x, CF_B4, Round(world_size=2, agreed=x.norm().reshape(1)))
    with pytest.raises(ValueError, match="world_size 2"):
        c.combine([p, p, p], ctx)
