"""Random-k with shared seeded indices."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gravac import compressors
from gravac.compressors import Round, k_for_cf, wire_bytes
from gravac.compressors import randomk as randomk_module
from gravac.compressors.base import Multilevel
from gravac.compressors.randomk import RandomKCompressor, RandomKContext, draw_distinct
from gravac.gain import compression_gain
from gravac.simulation import simulate

CPU = torch.device("cpu")


def _indices(ctx: object) -> torch.Tensor:
    assert isinstance(ctx, RandomKContext)
    return ctx.indices


def _chi_square_bound(df: int) -> float:
    """A generous upper bound for a chi-square statistic with ``df`` degrees of freedom
    (mean df, sd sqrt(2 df): mean + 5 sd is exceeded with probability below 1e-4)."""
    return df + 5 * math.sqrt(2 * df)


def test_every_rank_picks_the_same_indices() -> None:
    torch.manual_seed(0)
    c = compressors.create("randomk", seed=7)
    grads = [torch.randn(40, 50) for _ in range(4)]
    rnd = Round(step=11, key=3, world_size=4)
    contexts = [c.compress(g, 20.0, rnd)[1] for g in grads]
    first = _indices(contexts[0])
    assert first.numel() == k_for_cf(2000, 20.0) == 100
    for ctx in contexts[1:]:
        assert torch.equal(_indices(ctx), first)
    # The simulated round agrees: every worker sent exactly those positions.
    res = simulate(c, grads, 20.0, step=11, key=3)
    for sent in res.sent:
        assert torch.equal(torch.nonzero(sent.reshape(-1)).reshape(-1), first)


def test_indices_change_with_step_key_and_seed() -> None:
    c = compressors.create("randomk")
    x = torch.randn(10_000)

    def idx(c: compressors.Compressor, step: int, key: int) -> set[int]:
        return set(_indices(c.compress(x, 100.0, Round(step=step, key=key))[1]).tolist())

    base = idx(c, 5, 0)
    assert idx(c, 5, 0) == base  # deterministic
    # 100 of 10,000: two independent draws share about 1 index on average.
    for other in (idx(c, 6, 0), idx(c, 5, 1), idx(compressors.create("randomk", seed=1), 5, 0)):
        assert len(base & other) < 10


def test_values_all_reduce_to_the_mean_at_the_chosen_indices() -> None:
    torch.manual_seed(1)
    c = compressors.create("randomk")
    grads = [torch.randn(1000) for _ in range(5)]
    res = simulate(c, grads, 10.0, step=4, key=2)
    idx = _indices(c.compress(grads[0], 10.0, Round(step=4, key=2, world_size=5))[1])
    expected = torch.zeros(1000)
    expected[idx] = torch.stack(grads).mean(0)[idx]
    torch.testing.assert_close(res.mean, expected, rtol=1e-6, atol=1e-7)
    assert res.achieved_cf == 10.0
    # Only the values travel: k float32 values, no indices.
    assert res.wire_bytes == [100 * 4] * 5


def test_payload_values_are_x_at_the_indices_and_gain_is_kept_energy() -> None:
    torch.manual_seed(2)
    x = torch.randn(64, 33)
    c = compressors.create("randomk")
    payload, ctx = c.compress(x, 8.0, Round(step=1))
    idx = _indices(ctx)
    assert torch.equal(payload.values, x.reshape(-1)[idx])  # type: ignore[attr-defined]
    out = c.decompress(payload, ctx)
    kept = x.reshape(-1)[idx].double().square().sum() / x.double().square().sum()
    assert compression_gain(x, out) == pytest.approx(float(kept), rel=1e-6)  # float32 partials
    assert wire_bytes(payload) == idx.numel() * 4


def test_unbiased_option_is_unbiased_over_steps() -> None:
    """E[C(x)] = x with scale d/k: averaged over T steps every coordinate is within 4.5 standard
    errors of x (its standard error is |x_i| sqrt((d/k - 1) / T))."""
    torch.manual_seed(3)
    d, cf, steps = 50, 10.0, 4000
    x = torch.randn(d, dtype=torch.float64) + 0.5
    c = compressors.create("randomk", unbiased=True)
    total = torch.zeros(d, dtype=torch.float64)
    for step in range(steps):
        total += c.decompress(*c.compress(x, cf, Round(step=step)))
    mean = total / steps
    k = k_for_cf(d, cf)
    stderr = x.abs() * math.sqrt((d / k - 1) / steps)
    z = (mean - x) / stderr
    assert float(z.abs().max()) < 4.5
    # The default projection averages to x * k / d instead (5 standard errors of tolerance).
    proj = compressors.create("randomk")
    runs, p = 500, k / d
    avg = sum(proj.decompress(*proj.compress(x, cf, Round(step=s))) for s in range(runs)) / runs
    band = 5 * x.abs() * math.sqrt(p * (1 - p) / runs)
    assert bool(((avg - x * p).abs() <= band).all())


def test_unbiased_scale_and_projection_default() -> None:
    x = torch.randn(1000)
    biased = compressors.create("randomk")
    unbiased = compressors.create("randomk", unbiased=True)
    rnd = Round(step=9)
    out_b = biased.decompress(*biased.compress(x, 10.0, rnd))
    out_u = unbiased.decompress(*unbiased.compress(x, 10.0, rnd))
    torch.testing.assert_close(out_u, out_b * 10.0, rtol=1e-6, atol=0)
    assert torch.equal(out_b[out_b != 0], x[out_b != 0])


@pytest.mark.parametrize(("n", "k"), [(8, 2), (6, 3)], ids=["stream", "permutation"])
def test_draw_is_uniform_over_subsets(n: int, k: int) -> None:
    """Every k-subset of [0, n) is equally likely (chi-square over all C(n, k) subsets)."""
    subsets = math.comb(n, k)
    draws = 300 * subsets
    counts = Counter(
        tuple(draw_distinct(n, k, torch.Generator().manual_seed(s), CPU).tolist())
        for s in range(draws)
    )
    assert set(counts) == set(itertools.combinations(range(n), k))
    expected = draws / subsets
    stat = sum((counts[s] - expected) ** 2 / expected for s in counts)
    assert stat < _chi_square_bound(subsets - 1)


def test_draw_continues_the_stream_when_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first batch with too few distinct values is extended from the same stream, still
    exact k distinct sorted values and still uniform per element."""
    monkeypatch.setattr(randomk_module, "_STREAM_MARGIN", 0.5)
    monkeypatch.setattr(randomk_module, "_STREAM_SLACK", 0)
    n, k, draws = 40, 10, 4000
    counts = torch.zeros(n)
    for s in range(draws):
        idx = draw_distinct(n, k, torch.Generator().manual_seed(s), CPU)
        assert idx.numel() == k == idx.unique().numel()
        assert torch.equal(idx, idx.sort().values)
        counts[idx] += 1
    p = k / n
    stat = float(((counts - draws * p) ** 2 / (draws * p * (1 - p))).sum())
    assert stat < _chi_square_bound(n - 1)


def test_draw_edge_cases_and_large_sparse_draw() -> None:
    gen = torch.Generator().manual_seed(0)
    assert draw_distinct(0, 0, gen, CPU).numel() == 0
    assert torch.equal(draw_distinct(5, 5, gen, CPU), torch.arange(5))
    with pytest.raises(ValueError, match="distinct"):
        draw_distinct(3, 4, gen, CPU)
    idx = draw_distinct(16_000_000, 160_000, gen, CPU)
    assert idx.numel() == 160_000 == idx.unique().numel()
    assert int(idx.min()) >= 0 and int(idx.max()) < 16_000_000


@pytest.mark.parametrize(("cf1", "cf2"), [(2.0, 10.0), (10.0, 100.0), (10.0, 1000.0)])
def test_multilevel_is_a_shared_subset(cf1: float, cf2: float) -> None:
    torch.manual_seed(4)
    c = compressors.create("randomk")
    rnd = Round(step=3, key=1)
    xs = [torch.randn(20_000) for _ in range(3)]
    results = []
    for x in xs:
        p1, ctx1 = c.compress(x, cf1, rnd)
        p2, ctx2 = c.recompress(p1, ctx1, cf2, rnd)
        idx1, idx2 = _indices(ctx1), _indices(ctx2)
        assert idx2.numel() == k_for_cf(20_000, cf2)
        assert ctx2.achieved_cf == pytest.approx(cf2)
        assert set(idx2.tolist()) <= set(idx1.tolist())
        assert torch.equal(p2.values, x[idx2])  # type: ignore[attr-defined]
        results.append(idx2)
    for idx in results[1:]:
        assert torch.equal(idx, results[0])  # every rank recompresses identically


def test_multilevel_subset_is_uniform() -> None:
    """The recompressed set is uniform over the input coordinates, like direct compression."""
    d, steps = 40, 3000
    c = compressors.create("randomk")
    x = torch.randn(d)
    counts = torch.zeros(d)
    for step in range(steps):
        rnd = Round(step=step)
        _, ctx = c.recompress(*c.compress(x, 2.0, rnd), 8.0, rnd)
        counts[_indices(ctx)] += 1
    p_keep = k_for_cf(d, 8.0) / d
    stat = float(((counts - steps * p_keep) ** 2 / (steps * p_keep * (1 - p_keep))).sum())
    assert stat < _chi_square_bound(d - 1)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"seed": 1.5}, "randomk option seed must be an int, got 1.5"),
        ({"seed": True}, "randomk option seed"),
        ({"unbiased": 1}, "randomk option unbiased must be a bool, got 1"),
    ],
)
def test_bad_options_raise(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compressors.create("randomk", **opts)


def test_registry_flags() -> None:
    c = compressors.create("randomk")
    assert isinstance(c, RandomKCompressor)
    assert c.collective == "allreduce" and isinstance(c, Multilevel)
    assert compressors.options("randomk") == ["seed", "unbiased"]


@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    cf=st.floats(1.0, 500.0),
    seed=st.integers(0, 2**31 - 1),
    step=st.integers(0, 10**6),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
)
@settings(max_examples=60, deadline=None)
def test_property_exact_k_distinct_in_range(
    shape: list[int], cf: float, seed: int, step: int, dtype: torch.dtype
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    d = x.numel()
    c = compressors.create("randomk", seed=seed)
    payload, ctx = c.compress(x, cf, Round(step=step, key=seed % 7))
    idx = _indices(ctx)
    k = k_for_cf(d, cf)
    assert idx.numel() == k == idx.unique().numel()
    assert int(idx.min()) >= 0 and int(idx.max()) < d
    assert torch.equal(payload.values, x.reshape(-1)[idx])  # type: ignore[attr-defined]
    assert ctx.achieved_cf == d / k


def test_the_unbiased_residual_is_x_less_the_scaled_values_bit_for_bit() -> None:
    """With the d / k scale, the residual in place and the gain terms read off the payload are
    those of the dense decompression (bit for bit, and to float64 rounding)."""
    c = compressors.create("randomk", unbiased=True)
    x = torch.randn(30, 40)
    payload, ctx = c.compress(x, 8.0, Round(step=2))
    dense = c.decompress(payload, ctx)
    assert torch.equal(c.residual_(x.clone(), payload, ctx), x - dense)
    want = torch.stack([(dense.double() * x.double()).sum(), dense.double().square().sum()])
    torch.testing.assert_close(c.sent_terms(x, payload, ctx), want, rtol=1e-6, atol=0)
