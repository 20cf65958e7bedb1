"""TopK Chunked (TopKC): agreed chunk selection, exactness, multi-level, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, k_for_cf, wire_bytes
from gravac.compressors.base import Multilevel
from gravac.compressors.topkc import (
    DEFAULT_CHUNK_SIZE,
    TopKCContext,
    chunk_sq_norms,
    rank_chunks,
)
from gravac.memory import ResidualMemory
from gravac.simulation import reduce_stats, simulate


def _brute_force(x: torch.Tensor, norms: list[float], cf: float, chunk: int) -> torch.Tensor:
    """Reference: chunks by (-norm, id); the first k = round(d / cf) elements in that order."""
    flat = x.reshape(-1)
    d = flat.numel()
    k = k_for_cf(d, cf)
    order = sorted(range(len(norms)), key=lambda j: (-norms[j], j))
    positions: list[int] = []
    for j in order:
        positions.extend(range(j * chunk, min(d, (j + 1) * chunk)))
    out = torch.zeros_like(flat)
    keep = torch.tensor(positions[:k], dtype=torch.long)
    out[keep] = flat[keep]
    return out.view(x.shape)


def _agreed_round(c: compressors.Compressor, xs: list[torch.Tensor], step: int = 0) -> Round:
    probe = Round(step=step, world_size=len(xs))
    agreed = reduce_stats(c, [c.local_stats(x, 1.0, probe) for x in xs])
    return Round(step=step, world_size=len(xs), agreed=agreed)


def _ctx(ctx: object) -> TopKCContext:
    assert isinstance(ctx, TopKCContext)
    return ctx


def test_local_stats_are_chunk_squared_norms() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000)
    c = compressors.create("topkc", chunk_size=64)
    stats = c.local_stats(x, 10.0, Round())
    assert stats is not None and stats.shape == (16,)
    expected = torch.stack([x[j * 64 : (j + 1) * 64].square().sum() for j in range(16)])
    torch.testing.assert_close(stats, expected, rtol=1e-6, atol=0)
    assert c.local_stats(x.half(), 10.0, Round()).dtype == torch.float32  # type: ignore[union-attr]


@pytest.mark.parametrize("numel", [1, 7, 256, 1000, 4097])
@pytest.mark.parametrize("cf", [1.0, 2.5, 10.0, 300.0])
@pytest.mark.parametrize("chunk", [1, 16, 256])
def test_equals_brute_force_reference(numel: int, cf: float, chunk: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel)
    c = compressors.create("topkc", chunk_size=chunk)
    rnd = _agreed_round(c, [x])
    payload, ctx = c.compress(x, cf, rnd)
    norms = chunk_sq_norms(x, chunk).tolist()
    assert torch.equal(c.decompress(payload, ctx), _brute_force(x, norms, cf, chunk))
    k = k_for_cf(numel, cf)
    assert payload.values.numel() == k  # type: ignore[attr-defined]
    assert ctx.achieved_cf == numel / k
    assert wire_bytes(payload) == 4 * k


def test_ties_are_broken_by_chunk_index() -> None:
    x = torch.ones(64, 16).reshape(-1)  # 64 chunks of 16 with equal norms
    c = compressors.create("topkc", chunk_size=16)
    payload, ctx = c.compress(x, 8.0, _agreed_round(c, [x]))  # k = 128: eight chunks
    assert _ctx(ctx).chunk_ids.tolist() == list(range(8))
    out = c.decompress(payload, ctx)
    assert torch.equal(out, torch.cat([torch.ones(128), torch.zeros(1024 - 128)]))


def test_ranks_select_identical_chunks_when_local_norms_disagree() -> None:
    """Each worker's own top chunk differs; the agreed top chunk is the same everywhere."""
    chunk, n_chunks, workers = 16, 8, 3
    grads = []
    for i in range(workers):
        g = 0.01 * torch.randn(n_chunks, chunk, generator=torch.Generator().manual_seed(i))
        g[i] = 3.0  # local norm^2 144: the worker's own top chunk
        g[5] = 2.0  # norm^2 64 on every worker: 192 in total, the agreed top chunk
        grads.append(g.reshape(-1))
    c = compressors.create("topkc", chunk_size=chunk)
    cf = float(n_chunks)  # k = one chunk
    alone = Round(world_size=1)  # each worker by itself ranks by its own norms
    local = [_ctx(c.compress(g, cf, alone)[1]).chunk_ids for g in grads]
    assert [ids.tolist() for ids in local] == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"needs rnd\.agreed"):  # they would disagree
        c.compress(grads[0], cf, Round(world_size=workers))
    rnd = _agreed_round(c, grads)
    agreed = [_ctx(c.compress(g, cf, rnd)[1]).chunk_ids.tolist() for g in grads]
    assert agreed == [[5]] * workers
    res = simulate(c, grads, cf)
    expected = torch.zeros(n_chunks, chunk)
    expected[5] = torch.stack([g.view(n_chunks, chunk)[5] for g in grads]).sum(0) / workers
    torch.testing.assert_close(res.mean, expected.reshape(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(res.mean, torch.stack(res.sent).mean(0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("workers", [2, 4])
def test_error_feedback_identity_is_bit_exact(workers: int) -> None:
    gen = torch.Generator().manual_seed(7)
    c = compressors.create("topkc", chunk_size=32)
    memories = [ResidualMemory() for _ in range(workers)]
    for step in range(5):
        grads = [torch.randn(50, 21, generator=gen) for _ in range(workers)]
        e_old = [m.residuals.get(0, torch.zeros(50, 21)).clone() for m in memories]
        res = simulate(c, grads, 7.0, step=step, memories=memories)
        for g, e, sent, m in zip(grads, e_old, res.sent, memories, strict=True):
            assert torch.equal(g + e, sent + m.residuals[0])


@pytest.mark.parametrize(("cf1", "cf2"), [(2.0, 10.0), (10.0, 100.0), (3.0, 7.7), (5.0, 5.0)])
@pytest.mark.parametrize("numel", [20_000, 20_000 - 77])
def test_multilevel_equals_direct(cf1: float, cf2: float, numel: int) -> None:
    gen = torch.Generator().manual_seed(int(cf1 * cf2))
    xs = [torch.randn(numel, generator=gen) for _ in range(3)]
    c = compressors.create("topkc", chunk_size=100)
    rnd = _agreed_round(c, xs)
    for x in xs:
        p1, ctx1 = c.compress(x, cf1, rnd)
        p2, ctx2 = c.recompress(p1, ctx1, cf2, rnd)
        p3, ctx3 = c.compress(x, cf2, rnd)
        assert torch.equal(p2.values, p3.values)  # type: ignore[attr-defined]
        assert torch.equal(_ctx(ctx2).chunk_ids, _ctx(ctx3).chunk_ids)
        assert ctx2.achieved_cf == ctx3.achieved_cf
        assert torch.equal(c.decompress(p2, ctx2), c.decompress(p3, ctx3))


def test_recompress_to_a_smaller_cf_keeps_everything_it_has() -> None:
    x = torch.randn(5000)
    c = compressors.create("topkc")
    p1, ctx1 = c.compress(x, 10.0, Round())
    p2, ctx2 = c.recompress(p1, ctx1, 2.0, Round())
    assert torch.equal(c.decompress(p2, ctx2), c.decompress(p1, ctx1))


def test_short_last_chunk() -> None:
    """1000 elements in chunks of 256: the last chunk holds 232 and may be kept, first or cut."""
    x = 0.1 * torch.randn(1000, generator=torch.Generator().manual_seed(3))
    x[768:] += 5.0  # the short last chunk has the largest norm
    x[256:512] += 1.0  # then chunk 1
    c = compressors.create("topkc", chunk_size=256)
    assert c.local_stats(x, 1.0, Round()).shape == (4,)  # type: ignore[union-attr]
    payload, ctx = c.compress(x, 1000 / 300, Round())  # k = 300: 232 of chunk 3, 68 of chunk 1
    assert _ctx(ctx).chunk_ids.tolist() == [3, 1]
    assert payload.values.numel() == 300  # type: ignore[attr-defined]
    assert ctx.achieved_cf == pytest.approx(1000 / 300)
    expected = torch.zeros(1000)
    expected[768:] = x[768:]
    expected[256:324] = x[256:324]
    assert torch.equal(c.decompress(payload, ctx), expected)
    # k = 200 cuts the short chunk itself
    payload, ctx = c.compress(x, 5.0, Round())
    assert _ctx(ctx).chunk_ids.tolist() == [3]
    assert torch.equal(payload.values, x[768:968])  # type: ignore[attr-defined]
    # CF 1 sends everything
    assert torch.equal(c.decompress(*c.compress(x, 1.0, Round())), x)


def test_without_agreement_uses_own_norms() -> None:
    torch.manual_seed(4)
    x = torch.randn(3000)
    c = compressors.create("topkc", chunk_size=50)
    own = c.decompress(*c.compress(x, 6.0, Round()))
    agreed = c.decompress(*c.compress(x, 6.0, _agreed_round(c, [x])))
    assert torch.equal(own, agreed)


def test_agreed_stats_of_wrong_shape_raise() -> None:
    c = compressors.create("topkc", chunk_size=10)
    with pytest.raises(ValueError, match=r"one norm per chunk.*\(10,\)"):
        c.compress(torch.randn(100), 4.0, Round(agreed=torch.ones(11)))


def test_nonfinite_chunks_are_sent_first() -> None:
    x = torch.randn(1000)
    x[10], x[900] = math.nan, math.inf
    c = compressors.create("topkc", chunk_size=100)
    _, ctx = c.compress(x, 5.0, Round())  # k = 200: two chunks
    assert sorted(_ctx(ctx).chunk_ids.tolist()) == [0, 9]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "256", None])
def test_bad_chunk_size_raises(bad: object) -> None:
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        compressors.create("topkc", chunk_size=bad)


def test_defaults_and_repr() -> None:
    c = compressors.create("topkc")
    assert c.collective == "allreduce" and isinstance(c, Multilevel) and c.stats_rule.op == "sum"
    assert repr(c) == f"TopKCCompressor(chunk_size={DEFAULT_CHUNK_SIZE})"


@pytest.mark.parametrize("n_chunks", [1, 7, 1000])
def test_the_leading_chunks_are_the_full_rankings_prefix(n_chunks: int) -> None:
    gen = torch.Generator().manual_seed(n_chunks)
    norms = torch.randint(0, 5, (n_chunks,), generator=gen).float()  # many ties
    norms[torch.randint(0, n_chunks, (2,), generator=gen)] = torch.tensor([math.nan, math.inf])
    full = rank_chunks(norms)
    assert torch.equal(
        full,
        torch.sort(torch.nan_to_num(norms, nan=math.inf), descending=True, stable=True).indices,
    )
    for count in sorted({0, 1, 2, n_chunks // 3, n_chunks - 1, n_chunks, n_chunks + 5}):
        assert torch.equal(rank_chunks(norms, count), full[:count])


@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_chunk_norms_equal_the_sum_of_squares(numel: int, dtype: torch.dtype) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    got = chunk_sq_norms(x, 256)
    pad = -numel % 256
    want = torch.nn.functional.pad(x.double(), (0, pad)).view(-1, 256).square().sum(1)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
