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
