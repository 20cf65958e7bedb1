"""THC's CPU path against the reference: payloads bit for bit, decoding to rotation rounding."""

from __future__ import annotations

import math

import pytest
import torch

from gravac import compressors
from gravac.compressors import Compressor, Round, sum_payloads
from gravac.compressors.thc import (
    DEFAULT_GRANULARITY,
    DEFAULT_P,
    THCContext,
    THCLevelsPayload,
    THCPackedPayload,
    pack_lanes,
    thc_decode,
    thc_payload,
    unpack_lanes,
)
from gravac.compressors.thc.cpu import _top_clamp_needed
from gravac.compressors.thc.table import (
    clamp_threshold,
)
from tests.compressors.thc.common import CF_B4


@pytest.mark.parametrize("rotation", ["full", "partial"])
@pytest.mark.parametrize("transport", ["allreduce", "allgather"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [4096, 2**18, 2**19 + 4096])
def test_cpu_payload_is_the_reference_when_the_rotation_is_exact(
    rotation: str, transport: str, bits: int, n: int
) -> None:
    """Small integers, log2 B even: every partial sum of both rotations is exact and the scale
    2^(-log2 B / 2) a power of two, so the chunked CPU kernel sends the torch reference's payload
    bit for bit (2^18: one chunk; 2^19 + 4096: more than one, the last partial; full: a block
    longer than a chunk). The lanes cover one-byte and two-byte levels (b = 8: g = 510), lanes
    within a byte and across bytes."""
    _assert_cpu_payload_is_the_reference(
        compressors.create("thc", bits=bits, rotation=rotation, transport=transport), n, bits
    )


#: A clamped fraction whose shifted clamp rounds above g = 3 in float32 (``fl(2t * 3 / (2t))``
#: is 3 plus an ulp), so the CPU kernel keeps the reference's last clamp to ``[0, g]``.
_P_TOP_CLAMPED = 41 / 256


@pytest.mark.parametrize("bits", sorted(DEFAULT_P))
def test_cpu_kernel_skips_the_last_clamp_only_where_it_is_the_identity(bits: int) -> None:
    """For the default ``(g, p)`` the shifted clamp ``fl(fl(clamp(y, +-t) + t) * g / (2t))``
    stays in ``[+0, g]`` for every ``y`` (the edges, non-finite values and a dense grid), so the
    kernel's skipped clamp to ``[0, g]`` changes no bit; where it could, it is kept."""
    g, t = DEFAULT_GRANULARITY[bits], clamp_threshold(DEFAULT_P[bits])
    edges = torch.tensor([t, -t, math.inf, -math.inf, math.nan, 0.0, -0.0])
    y = torch.cat([torch.linspace(-2 * t, 2 * t, 100_001), edges, edges.nextafter(edges * 2)])
    shifted = torch.nan_to_num(y, nan=0.0).clamp_(-t, t).add_(t).mul_(g / (2.0 * t))
    assert not _top_clamp_needed(t, g / (2.0 * t), g)
    assert torch.equal(shifted.view(torch.int32), shifted.clamp(0.0, g).view(torch.int32))
    t_kept = clamp_threshold(_P_TOP_CLAMPED)
    assert _top_clamp_needed(t_kept, 3 / (2.0 * t_kept), 3)


@pytest.mark.parametrize("transport", ["allreduce", "allgather"])
def test_cpu_payload_with_the_last_clamp_kept(transport: str) -> None:
    c = compressors.create("thc", bits=2, p=_P_TOP_CLAMPED, transport=transport)
    _assert_cpu_payload_is_the_reference(c, 2**18, 2)


def _assert_cpu_payload_is_the_reference(c: Compressor, n: int, bits: int) -> None:
    x = torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(bits)).float()
    rnd = Round(step=3, world_size=2, agreed=c.local_stats(x, CF_B4, Round()))
    payload, ctx = c.compress(x, CF_B4, rnd)
    assert isinstance(ctx, THCContext)
    lane = torch.int32 if isinstance(payload, THCLevelsPayload) else None
    ref = thc_payload(x, ctx.norms, ctx.table, ctx.encoding, lane=lane, backend="torch")
    if isinstance(payload, THCLevelsPayload):
        assert torch.equal(payload.words, pack_lanes(ref, ctx.lane_bits))
    else:
        assert isinstance(payload, THCPackedPayload) and torch.equal(payload.indices, ref)


#: Float32 unit roundoff.
_U32 = 2.0**-24


@pytest.mark.parametrize("rotation", ["full", "partial"])
@pytest.mark.parametrize("n", [3000, 2**18 + 5])
def test_cpu_decode_equals_the_reference_to_the_rotation_rounding(rotation: str, n: int) -> None:
    """The chunked CPU decoder against :func:`thc_decode` (butterflies) on 4 ranks' summed lanes.

    Both apply the same affine map bit for bit, then the orthonormal transform in two summation
    orders: each of the ``log2 B`` stages of either adds a rounding error of at most ``u`` times
    the norm of its output (``u = 2^-24``; the stages are orthogonal, so norms are kept), hence
    ``||fast - ref|| <= 2 log2(B) u ||ref||``; the diagonal flips signs exactly.
    """
    c = compressors.create("thc", bits=4, rotation=rotation)
    gen = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, generator=gen) for _ in range(4)]
    stats = torch.stack([c.local_stats(x, CF_B4, Round()) for x in xs]).amax(0)  # type: ignore[misc]
    rnd = Round(step=1, world_size=4, agreed=stats)
    compressed = [c.compress(x, CF_B4, rnd) for x in xs]
    reduced = sum_payloads([p for p, _ in compressed])
    ctx = compressed[0][1]
    assert isinstance(reduced, THCLevelsPayload) and isinstance(ctx, THCContext)
    fast = c.decompress(reduced, ctx)
    ref = thc_decode(unpack_lanes(reduced.words, ctx.lane_bits, ctx.padded), reduced.count, ctx)
    bound = 2 * math.log2(ctx.block) * _U32 * float(ref.double().norm())
    assert float((fast.double() - ref.double()).norm()) <= bound
    packed = compressors.create("thc", bits=4, rotation=rotation, transport="allgather")
    gathered = [packed.compress(x, CF_B4, rnd) for x in xs]
    total = packed.combine([p for p, _ in gathered], gathered[0][1])
    torch.testing.assert_close(total, fast, rtol=0, atol=0)


#: float32's least normal magnitude, 2^-126.
_TINY32 = torch.finfo(torch.float32).tiny
#: The binades between the last block of :func:`_tiny_tail` and its scaled-up copy: its
#: entries (about N(0, 1) times 2^-129) are subnormal, its norm (about 2^-124) is not.
_TAIL_BINADES = 129


def _tiny_tail(seed: int, rotation: str) -> tuple[torch.Tensor, int]:
    """``x``: N(0, 1) values, every third one times ``2^-140``, and a last block (of THC's
    partial rotation, or 1024 elements) of N(0, 1) times ``2^-129`` (all subnormal); and the
    block's length."""
    n = 2**18 + 4096
    block = compressors.create("thc").layout(n)[0] if rotation == "partial" else 1024
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    x[::3] *= 2.0**-140
    x[-block:] = torch.ldexp(torch.randn(block, generator=gen), torch.tensor(-_TAIL_BINADES))
    assert bool((x[-block:].abs() < _TINY32).all())
    return x, block


def _payload_tensors(c: Compressor, x: torch.Tensor, rnd: Round) -> list[torch.Tensor]:
    payload, _ = c.compress(x, CF_B4, rnd)
    return list(vars(payload).values())


@pytest.mark.parametrize("rotation", ["full", "partial"])
@pytest.mark.parametrize("transport", ["allreduce", "allgather"])
def test_cpu_payload_drops_entries_negligible_to_their_block(rotation: str, transport: str) -> None:
    """Entries below ``2^-64`` of their block's norm (here ``2^-140`` of N(0, 1) values) are
    sent as zeros: under the same agreed norms ``x`` and ``x`` with them zeroed send the same
    payload bit for bit (the block of subnormal entries, not negligible to its own norm in the
    partial rotation, is kept in both)."""
    x, block = _tiny_tail(0, rotation)
    c = compressors.create("thc", bits=4, rotation=rotation, transport=transport)
    zeroed = x.clone()
    zeroed[:-block][::3] = 0.0
    rnd = Round(step=2, world_size=2, agreed=c.local_stats(x, CF_B4, Round()))
    for a, b in zip(_payload_tensors(c, x, rnd), _payload_tensors(c, zeroed, rnd), strict=True):
        assert torch.equal(a, b)


def _tail_scaled_up(
    c: Compressor, x: torch.Tensor, block: int
) -> tuple[torch.Tensor, Round, Round]:
    """``x`` with its last block scaled up by ``2^129`` (exact), and the rounds of ``x`` and of
    the copy: the same agreed norms but the last, scaled alike (both normal, so exact)."""
    big = x.clone()
    big[-block:] = torch.ldexp(x[-block:], torch.tensor(_TAIL_BINADES))
    agreed_big = c.local_stats(big, CF_B4, Round())
    assert agreed_big is not None
    agreed = agreed_big.clone()
    agreed[-1] = torch.ldexp(agreed_big[-1], torch.tensor(-_TAIL_BINADES))
    assert torch.equal(torch.ldexp(agreed[-1], torch.tensor(_TAIL_BINADES)), agreed_big[-1])
    return (
        big,
        Round(step=2, world_size=2, agreed=agreed),
        Round(step=2, world_size=2, agreed=agreed_big),
    )


@pytest.mark.parametrize("transport", ["allreduce", "allgather"])
def test_cpu_payload_of_a_subnormal_block_is_that_of_its_scaled_up_copy(transport: str) -> None:
    """The CPU kernel rotates each block in units of its norm's binade (the GEMMs' slow path
    on x86 runs on subnormals), so the encoding is scale-free: a block of subnormal entries
    sends what the same block ``2^129`` times larger sends under a norm ``2^129`` times larger,
    bit for bit (rotated as they are, the subnormal values would lose bits)."""
    c = compressors.create("thc", bits=4, rotation="partial", transport=transport)
    x, block = _tiny_tail(0, "partial")
    big, rnd, rnd_big = _tail_scaled_up(c, x, block)
    for a, b in zip(_payload_tensors(c, x, rnd), _payload_tensors(c, big, rnd_big), strict=True):
        assert torch.equal(a, b)


def test_cpu_decode_of_a_subnormal_block_is_that_of_its_scaled_up_copy() -> None:
    """Two ranks' payloads of :func:`_tiny_tail` vectors decode, under the tiny norm, to
    exactly ``2^-129`` times what the scaled-up copies decode to under the larger norm (the
    values are decoded in units of the norm, so only the last multiply rounds, once), and
    elsewhere to the same values."""
    c = compressors.create("thc", bits=4, rotation="partial")
    ranks = []
    for rank in range(2):
        x, block = _tiny_tail(rank, "partial")
        ranks.append((x, *_tail_scaled_up(c, x, block)))
    decoded = []
    for pairs in (
        [c.compress(x, CF_B4, rnd) for x, _, rnd, _ in ranks],
        [c.compress(big, CF_B4, rnd_big) for _, big, _, rnd_big in ranks],
    ):
        reduced = sum_payloads([p for p, _ in pairs])
        decoded.append(c.decompress(reduced, pairs[0][1]))
    small, big = decoded
    assert torch.equal(small[:-block], big[:-block])
    assert torch.equal(small[-block:], torch.ldexp(big[-block:], torch.tensor(-_TAIL_BINADES)))
    assert bool((small[-block:].abs() < _TINY32).any())
