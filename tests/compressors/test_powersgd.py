"""PowerSGD: exactness on low-rank input, warm start, rank agreement, state, edge cases."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gravac import compressors
from gravac.compressors import Round
from gravac.compressors.base import Multilevel
from gravac.compressors.powersgd import (
    LEFT,
    RIGHT,
    PowerSGDCompressor,
    PowerSGDContext,
    PowerSGDPayload,
    _matrix_view,
    orthonormalize,
    rank_for_cf,
)
from gravac.memory import ResidualMemory
from gravac.simulation import simulate

#: float32 reconstruction of exactly representable input, relative to the input's norm.
EXACT_RTOL = 1e-5


def _psgd(**opts: object) -> PowerSGDCompressor:
    c = compressors.create("powersgd", **opts)
    assert isinstance(c, PowerSGDCompressor)
    return c


def _step(
    c: PowerSGDCompressor,
    x: Tensor,
    cf: float,
    step: int,
    *,
    key: int = 0,
    layout: tuple[torch.Size, ...] | None = None,
) -> tuple[Tensor, PowerSGDContext]:
    """One single-worker round: compress, then combine (which advances the shared bases)."""
    payload, ctx = c.compress(x, cf, Round(step=step, key=key, layout=layout))
    assert isinstance(ctx, PowerSGDContext)
    return c.combine([payload], ctx), ctx


def _low_rank(m: int, n: int, r: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=gen) @ torch.randn(r, n, generator=gen)


def _rel_err(approx: Tensor, x: Tensor) -> float:
    return float((approx - x).norm() / x.norm())


def _cf_for_rank(m: int, n: int, r: int) -> float:
    cf = m * n / (r * (m + n))
    assert rank_for_cf(m, n, cf) == r
    return cf


def _bases(c: PowerSGDCompressor, key: int = 0) -> dict[int, tuple[Tensor, int]]:
    entry = c.state_dict()["keys"][key]
    return {i: (b, entry["sides"][i]) for i, b in entry["bases"].items()}


def _assert_orthonormal(b: Tensor) -> None:
    eye = torch.eye(b.shape[1])
    torch.testing.assert_close(b.t() @ b, eye, rtol=0, atol=1e-5)


def test_rank_for_cf() -> None:
    assert rank_for_cf(100, 100, 10.0) == 5  # 10^4 / (10 * 200)
    assert rank_for_cf(100, 100, 1e6) == 1  # at least 1
    assert rank_for_cf(3, 1000, 1.0) == 2  # floor(3000 / 1003)
    assert rank_for_cf(2, 2, 0.5 + 0.5) == 1


def test_exact_on_a_rank_r_matrix_once_the_basis_is_aligned() -> None:
    """What this proves: for M = U V^T of rank r, a left step sends P = M Q0 whose span is
    span(U) (V^T Q0 is invertible for a random Q0), so the aggregated P orthonormalised in
    combine() is a basis P^ of M's column space, and the right step's P^ (M^T P^)^T = P^ P^^T M
    equals M. The left step itself (M Q0 Q0^T, a random projection of the rows) is not exact,
    and neither step needs more than the one factor per step."""
    m, n, r = 60, 40, 3
    x = _low_rank(m, n, r, seed=0)
    c = _psgd()
    cf = _cf_for_rank(m, n, r)
    out0, ctx0 = _step(c, x, cf, step=0)
    assert ctx0.plans[0].side == LEFT and ctx0.plans[0].rank == r
    assert _rel_err(out0, x) > 0.1
    out1, ctx1 = _step(c, x, cf, step=1)
    assert ctx1.plans[0].side == RIGHT
    assert _rel_err(out1, x) < EXACT_RTOL
    out2, ctx2 = _step(c, x, cf, step=2)  # Q^ now spans M's row space: exact on the left too
    assert ctx2.plans[0].side == LEFT
    assert _rel_err(out2, x) < EXACT_RTOL
    # one factor per step: m r elements on the left step, n r on the right one
    assert ctx0.achieved_cf == m * n / (m * r)
    assert ctx1.achieved_cf == m * n / (n * r)


def test_error_feedback_identity_through_steps() -> None:
    gen = torch.Generator().manual_seed(1)
    workers = 3
    c = _psgd()
    memories = [ResidualMemory() for _ in range(workers)]
    for step in range(5):
        grads = [torch.randn(40, 30, generator=gen) for _ in range(workers)]
        e_old = [m.residuals.get(0, torch.zeros(40, 30)).clone() for m in memories]
        res = simulate(c, grads, 8.0, step=step, memories=memories)
        for g, e, sent, m in zip(grads, e_old, res.sent, memories, strict=True):
            lhs, rhs = g + e, sent + m.residuals[0]
            scale = max(float(lhs.abs().max()), float(sent.abs().max()))
            torch.testing.assert_close(rhs, lhs, rtol=0, atol=4 * torch.finfo().eps * scale)


def test_warm_start_beats_a_fresh_power_iteration() -> None:
    """On a fixed matrix with decaying spectrum, eight warm-started alternating steps (four power
    iterations) approximate at least as well as one power iteration from any of ten random
    starts, and come within 2% of the best rank-r error (truncated SVD)."""
    m, n, r = 96, 64, 4
    gen = torch.Generator().manual_seed(2)
    u = torch.linalg.qr(torch.randn(m, n, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(n, n, generator=gen)).Q
    x = (u * 0.8 ** torch.arange(n)) @ v.t()
    c = _psgd()
    cf = _cf_for_rank(m, n, r)
    errors = [_rel_err(_step(c, x, cf, step=t)[0], x) for t in range(8)]
    fresh = []
    for seed in range(10):
        q = orthonormalize(torch.randn(n, r, generator=torch.Generator().manual_seed(seed)))
        p = orthonormalize(x @ q)
        fresh.append(_rel_err(p @ (x.t() @ p).t(), x))
    best = float(torch.linalg.svdvals(x)[r:].norm() / x.norm())
    assert errors[-1] <= min(fresh)
    assert errors[-1] <= 1.02 * best
    assert errors[-1] < errors[0]


def test_warm_start_off_draws_a_fresh_basis_each_step() -> None:
    x = torch.randn(50, 40)
    c = _psgd(warm_start=False)
    a, ctx_a = _step(c, x, 10.0, step=3)
    b, _ = _step(c, x, 10.0, step=3)
    d, ctx_d = _step(c, x, 10.0, step=4)
    assert torch.equal(a, b)  # seeded by step: reproducible
    assert not torch.equal(a, d)
    assert ctx_a.plans[0].side == ctx_d.plans[0].side == LEFT
    assert c.state_dict() == {"keys": {}}


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_ranks_agree_and_aggregate_is_the_mean_of_reconstructions(workers: int) -> None:
    """One compressor per rank (as on real ranks) and the shared instance of simulate(): every
    rank's combine() of the summed payloads gives the same tensor, equal to simulate's mean and
    to the mean of the per-worker reconstructions, step after step; the states stay equal."""
    gen = torch.Generator().manual_seed(workers)
    layout = (torch.Size([30, 20]), torch.Size([7]), torch.Size([16, 2, 8]))
    numel = 30 * 20 + 7 + 16 * 16
    ranks = [_psgd(min_numel=0) for _ in range(workers)]
    shared = _psgd(min_numel=0)
    for step in range(5):
        base = _low_rank(1, numel, 1, seed=step).reshape(-1)
        grads = [base + 0.3 * torch.randn(numel, generator=gen) for _ in range(workers)]
        rnd = Round(step=step, key=4, world_size=workers, layout=layout)
        compressed = [c.compress(g, 6.0, rnd) for c, g in zip(ranks, grads, strict=True)]
        payloads = [p for p, _ in compressed]
        outs = [c.combine(payloads, ctx) for c, (_, ctx) in zip(ranks, compressed, strict=True)]
        for out in outs[1:]:
            assert torch.equal(out, outs[0])
        # simulate() has no layout argument: the same step through the shared instance by hand
        res_payloads = [shared.compress(g, 6.0, rnd) for g in grads]
        total = shared.combine([p for p, _ in res_payloads], res_payloads[0][1])
        assert torch.equal(total, outs[0])
        sent = [c.decompress(p, ctx) for c, (p, ctx) in zip(ranks, compressed, strict=True)]
        torch.testing.assert_close(outs[0] / workers, torch.stack(sent).mean(0), rtol=0, atol=1e-5)
    states = [c.state_dict()["keys"][4] for c in [*ranks, shared]]
    for state in states[1:]:
        assert state["sides"] == states[0]["sides"]
        for i, b in state["bases"].items():
            assert torch.equal(b, states[0]["bases"][i])


@pytest.mark.parametrize("workers", [2, 4])
def test_simulate_mean_equals_mean_of_sent(workers: int) -> None:
    gen = torch.Generator().manual_seed(10 + workers)
    c = _psgd()
    for step in range(4):
        grads = [torch.randn(48, 36, generator=gen) for _ in range(workers)]
        res = simulate(c, grads, 5.0, step=step, key=1)
        torch.testing.assert_close(res.mean, torch.stack(res.sent).mean(0), rtol=0, atol=1e-5)


def test_rank_changes_up_and_down() -> None:
    m, n = 64, 48
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(5))
    c = _psgd()
    previous: tuple[Tensor, int] | None = None
    for step, r in enumerate([2, 6, 1, 4, 4, 9, 3]):
        out, ctx = _step(c, x, _cf_for_rank(m, n, r), step=step)
        plan = ctx.plans[0]
        assert plan.rank == r and torch.isfinite(out).all()
        assert plan.basis is not None
        _assert_orthonormal(plan.basis)
        if previous is not None:
            old, side = previous
            assert plan.side == side
            have = min(r, old.shape[1])
            if r <= old.shape[1]:  # down: the leading columns, as they are
                assert torch.equal(plan.basis, old[:, :r])
            else:  # up: the old span is kept, new columns orthogonal to it
                kept = plan.basis[:, :have]
                torch.testing.assert_close(kept @ (kept.t() @ old), old, rtol=0, atol=1e-5)
        previous = _bases(c)[0]
        assert previous[0].shape[1] == r


def test_compress_is_pure_and_only_combine_moves_the_state() -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(6))
    c = _psgd()
    _step(c, x, 8.0, step=0)
    before = c.state_dict()
    _, ctx_low = c.compress(x, 4.0, Round(step=1))  # theta_min
    high, ctx_high = c.compress(x, 32.0, Round(step=1))  # a candidate
    again, _ = c.compress(x, 32.0, Round(step=1))
    assert isinstance(high, PowerSGDPayload) and isinstance(again, PowerSGDPayload)
    assert torch.equal(high.factors, again.factors)
    after = c.state_dict()
    assert torch.equal(after["keys"][0]["bases"][0], before["keys"][0]["bases"][0])
    c.combine([high], ctx_high)
    basis, side = _bases(c)[0]
    assert basis.shape[1] == rank_for_cf(64, 64, 32.0) and side == LEFT
    assert isinstance(ctx_low, PowerSGDContext) and ctx_low.plans[0].rank == 8


def test_one_dimensional_and_small_tensors_go_dense_exactly() -> None:
    layout = (
        torch.Size([300]),  # 1-D
        torch.Size([8, 8]),  # 64 < min_numel
        torch.Size([2, 600]),  # rank 1 at CF 2 compresses 1200 / 602 < 2 times
        torch.Size([4, 300]),  # rank 1 at CF 2 compresses 1200 / 304 times: low rank
    )
    x = torch.randn(300 + 64 + 1200 + 1200, generator=torch.Generator().manual_seed(7))
    c = _psgd(min_numel=100)
    for step in range(3):
        out, ctx = _step(c, x, 2.0, step=step, layout=layout)
        assert [p.rank for p in ctx.plans] == [0, 0, 0, 1]
        assert torch.equal(out[: 300 + 64 + 1200], x[: 300 + 64 + 1200])
        assert not torch.equal(out[-1200:], x[-1200:])
    x16 = torch.randn(10, 3).half()  # below min_numel: the exact values, in their dtype
    out16, _ = _step(_psgd(), x16, 10.0, step=0)
    assert out16.dtype == torch.float16 and torch.equal(out16, x16)


def test_several_tensors_in_one_bucket() -> None:
    """Each matrix is viewed as (shape[0], -1) and compressed on its own: with every matrix of
    rank at most its rank, the second (right) step is exact for the whole bucket."""
    a = _low_rank(32, 16, 4, seed=8)
    b = _low_rank(8, 12, 2, seed=9).view(8, 4, 3)
    v1, v2 = torch.randn(10), torch.randn(64)
    layout = (a.shape, v1.shape, b.shape, v2.shape)
    x = torch.cat([a.reshape(-1), v1, b.reshape(-1), v2])
    c = _psgd(min_numel=0)
    cf = 2.4  # rank 4 for 32 x 16, rank 2 for 8 x 12
    out0, ctx0 = _step(c, x, cf, step=0, layout=layout)
    assert [p.rank for p in ctx0.plans] == [4, 0, 2, 0]
    assert ctx0.achieved_cf == x.numel() / (32 * 4 + 10 + 8 * 2 + 64)
    assert torch.equal(out0[512:522], v1) and torch.equal(out0[-64:], v2)
    out1, ctx1 = _step(c, x, cf, step=1, layout=layout)
    assert ctx1.achieved_cf == x.numel() / (16 * 4 + 10 + 12 * 2 + 64)
    assert _rel_err(out1, x) < EXACT_RTOL
    assert _rel_err(out1[:512], a.reshape(-1)) < EXACT_RTOL
    assert _rel_err(out1[522:618], b.reshape(-1)) < EXACT_RTOL


def test_ranks_given_replace_the_cf_per_tensor() -> None:
    """``Round.ranks`` (Accordion's per-layer ranks) sends each matrix at its rank whatever the
    CF; a vector and a matrix whose rate at that rank is below ``min_compression_rate`` go
    dense as under a CF; a rank for each tensor, >= 1."""
    layout = (torch.Size([32, 16]), torch.Size([10]), torch.Size([8, 12]), torch.Size([6, 6]))
    x = torch.randn(sum(s.numel() for s in layout), generator=torch.Generator().manual_seed(3))
    c = _psgd(min_numel=0, min_compression_rate=1.0)
    _, ctx = c.compress(x, 1000.0, Round(layout=layout, ranks=(4, 4, 2, 4)))
    assert [p.rank for p in ctx.plans] == [4, 0, 2, 0]  # 6 x 6 at rank 4: a rate of 0.75
    assert ctx.achieved_cf == x.numel() / (32 * 4 + 10 + 8 * 2 + 36)  # the left factors
    with pytest.raises(ValueError, match="a rank for each of the layout's 4 tensors"):
        c.compress(x, 4.0, Round(layout=layout, ranks=(4, 1)))
    with pytest.raises(ValueError, match=r"Round\.ranks must be integers >= 1"):
        Round(layout=layout, ranks=(4, 0, 1, 1))


def test_new_layout_resets_the_key() -> None:
    x = torch.randn(1200, generator=torch.Generator().manual_seed(11))
    c = _psgd()
    for step in range(3):
        _step(c, x, 4.0, step=step, layout=(torch.Size([40, 30]),))
    other = (torch.Size([30, 40]),)
    out, ctx = _step(c, x, 4.0, step=3, layout=other)
    fresh, _ = _step(_psgd(), x, 4.0, step=3, layout=other)
    assert torch.equal(out, fresh) and ctx.plans[0].side == LEFT
    assert c.state_dict()["keys"][0]["layout"] == [[30, 40]]


def test_layout_that_does_not_fit_raises() -> None:
    with pytest.raises(ValueError, match="layout must describe x"):
        _psgd().compress(torch.randn(100), 4.0, Round(layout=(torch.Size([10, 11]),)))


def test_state_dict_round_trip_resumes_identically() -> None:
    gen = torch.Generator().manual_seed(12)
    grads = [torch.randn(50, 40, generator=gen) for _ in range(6)]
    c = _psgd(seed=3)
    for step in range(3):
        for key in (0, 1):
            _step(c, grads[step] * (key + 1), 6.0, step=step, key=key)
    buffer = io.BytesIO()
    torch.save(c.state_dict(), buffer)
    buffer.seek(0)
    resumed = _psgd(seed=3)
    resumed.load_state_dict(torch.load(buffer))
    for step in range(3, 6):
        for key in (0, 1):
            a, _ = _step(c, grads[step], 6.0 + step, step=step, key=key)
            b, _ = _step(resumed, grads[step], 6.0 + step, step=step, key=key)
            assert torch.equal(a, b)


def test_load_state_dict_rejects_bad_state() -> None:
    c = _psgd()
    with pytest.raises(ValueError, match="unknown entries"):
        c.load_state_dict({"bogus": 1})
    bad = {"keys": {0: {"layout": [[10, 20]], "bases": {0: torch.zeros(7, 2)}, "sides": {0: 0}}}}
    with pytest.raises(ValueError, match=r"expected \(20, rank\)"):
        c.load_state_dict(bad)


@pytest.mark.parametrize("kind", ["zero", "rank1", "duplicate_columns"])
def test_rank_deficient_input_gives_no_nan(kind: str) -> None:
    m, n, r = 40, 30, 4
    if kind == "zero":
        x = torch.zeros(m, n)
    elif kind == "rank1":
        x = _low_rank(m, n, 1, seed=13)
    else:
        x = torch.randn(m, 1).repeat(1, n)
    c = _psgd()
    cf = _cf_for_rank(m, n, r)
    for step in range(4):
        res = simulate(c, [x, 2 * x], cf, step=step)
        assert torch.isfinite(res.mean).all()
        for basis, _ in _bases(c).values():
            _assert_orthonormal(basis)
        if step >= 1:  # aligned: exact (the zero matrix stays exactly zero)
            torch.testing.assert_close(
                res.mean, 1.5 * x, rtol=0, atol=1e-5 * (1 + float(x.abs().max()))
            )


def test_nonfinite_aggregate_keeps_the_basis() -> None:
    x = torch.randn(40, 30)
    c = _psgd()
    _step(c, x, 5.0, step=0)
    before = _bases(c)[0]
    bad = x.clone()
    bad[3, 4] = math.nan
    _step(c, bad, 5.0, step=1)
    after = _bases(c)[0]
    assert torch.equal(after[0], before[0]) and after[1] == before[1]
    out, _ = _step(c, x, 5.0, step=2)
    assert torch.isfinite(out).all()


def test_float64_and_half_inputs() -> None:
    x = torch.randn(64, 48, dtype=torch.float64)
    payload, ctx = _psgd().compress(x, 4.0, Round())
    assert payload.factors.dtype == torch.float64
    assert _psgd().decompress(payload, ctx).dtype == torch.float64
    h = x.to(torch.bfloat16)
    payload, ctx = _psgd().compress(h, 4.0, Round())
    assert payload.factors.dtype == torch.float32
    assert _psgd().decompress(payload, ctx).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("seed", -1),
        ("seed", 1.5),
        ("seed", True),
        ("warm_start", 1),
        ("warm_start", "yes"),
        ("min_compression_rate", 0.5),
        ("min_compression_rate", math.nan),
        ("min_compression_rate", math.inf),
        ("min_compression_rate", True),
        ("min_numel", -1),
        ("min_numel", 2.0),
    ],
)
def test_bad_options_raise(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{option} must be .*got {value!r}"):
        compressors.create("powersgd", **{option: value})


def test_defaults_and_repr() -> None:
    c = _psgd()
    assert c.collective == "allreduce" and not isinstance(c, Multilevel)
    assert repr(c) == (
        "PowerSGDCompressor(seed=0, warm_start=True, min_compression_rate=2.0, min_numel=256)"
    )


# -- deliverable CFs over a bound layout ------------------------------------------------------

#: A layout of mixed matrices, a conv kernel, a small matrix that cannot reach high CFs and a
#: dense vector, so that the rule's per-matrix rounding moves the layout's CF.
MIXED = tuple(
    torch.Size(s)
    for s in [(64, 1, 3, 3), (128, 64, 3, 3), (640, 2048), (10, 640), (300, 301), (77,)]
)


def _rank_rule_cf(shapes: tuple[torch.Size, ...], ctx: PowerSGDContext) -> float:
    """The CF (docs/design.md section 1) of the ranks used: numel over r (m + n), or numel sent."""
    sent = sum(p.numel if p.rank == 0 else p.rank * (p.rows + p.cols) for p in ctx.plans)
    return sum(math.prod(s) for s in shapes) / sent


def test_unbound_it_plans_the_cf_asked_for() -> None:
    assert _psgd().deliverable_cf(37.5) == 37.5


@settings(max_examples=40, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200)), min_size=1, max_size=5),
    cf=st.floats(1.0, 3000.0),
)
def test_a_bound_layout_delivers_the_cf_it_snaps_to(dims: list[tuple[int, int]], cf: float) -> None:
    shapes = tuple(torch.Size(d) for d in dims)
    c = _psgd()
    c.bind_shapes(shapes)
    snapped = c.deliverable_cf(cf)
    assert c.deliverable_cf(snapped) == snapped  # snapping twice changes nothing
    x = torch.randn(sum(math.prod(s) for s in shapes))
    _, ctx = c.compress(x, snapped, Round(layout=shapes))
    assert math.isclose(_rank_rule_cf(shapes, ctx), snapped, rel_tol=1e-12)


#: a fine grid of requested CFs, 1 to 10^4
KNOBS = torch.logspace(0, 4, 3000, dtype=torch.float64).tolist()


def _plain_rule_cf(shapes: tuple[torch.Size, ...], knob: float) -> float:
    """The CF of the ranks the plain (unbound) rule gives each of ``shapes`` at ``knob``."""
    c = _psgd()
    sent = 0
    for s in shapes:
        rank, (m, n) = c.rank_for(s, knob), _matrix_view(s)
        sent += m * n if rank == 0 else rank * (m + n)
    return sum(math.prod(s) for s in shapes) / sent


@pytest.fixture(scope="module")
def reachable() -> list[float]:
    """Every CF the plain rule's ranks deliver over MIXED at a fine grid of requests."""
    return [_plain_rule_cf(MIXED, k) for k in KNOBS]


def test_the_plain_rule_is_what_a_compression_sends(reachable: list[float]) -> None:
    """``reachable`` reads the ranks off the rule; a compression at every 100th request of the
    grid sends exactly those (3000 compressions of the whole layout took minutes)."""
    plain, x = _psgd(), torch.zeros(sum(math.prod(s) for s in MIXED))
    for knob, cf in list(zip(KNOBS, reachable, strict=True))[::100]:
        assert _rank_rule_cf(MIXED, plain.compress(x, knob, Round(layout=MIXED))[1]) == cf


@pytest.mark.parametrize("cf", [1.3, 2.0, 3.0, 10.0, 20.0, 50.0, 100.0, 400.0, 5000.0])
def test_it_snaps_to_the_nearest_cf_the_layout_delivers(cf: float, reachable: list[float]) -> None:
    c = _psgd()
    c.bind_shapes(MIXED)
    snapped = c.deliverable_cf(cf)
    assert any(math.isclose(snapped, r, rel_tol=1e-12) for r in reachable)
    assert abs(math.log(snapped / cf)) <= min(abs(math.log(r / cf)) for r in reachable) + 1e-12


def test_the_rule_alone_would_not_deliver_the_cf_it_asks_for(reachable: list[float]) -> None:
    """Why the layout is bound: the ranks the rule picks for CF 10 deliver another CF."""
    assert not any(math.isclose(10.0, r, rel_tol=1e-6) for r in reachable)


def test_factors_and_reconstruction_are_the_matrix_products() -> None:
    """The factors written into the payload are ``M Q`` (left step: the same BLAS call, so bit
    for bit) and ``M^T P^`` (right step, computed as ``(P^^T M)^T``: the same dot products of
    ``k`` terms summed in another order, so within the standard bound ``gamma_k |M|^T |P^|``,
    ``gamma_k = k u / (1 - k u)``, of the float64 product); the reconstruction is
    ``P Q^T`` / ``P^ Q^T`` bit for bit; a held result survives later rounds."""
    layout = (torch.Size([96, 160]), torch.Size([50]), torch.Size([160, 96]))
    gen = torch.Generator().manual_seed(13)
    c = _psgd()
    held: list[tuple[Tensor, Tensor]] = []
    for step in range(4):
        x = torch.randn(sum(s.numel() for s in layout), generator=gen)
        payload, ctx = c.compress(x, 8.0, Round(step=step, layout=layout))
        assert isinstance(payload, PowerSGDPayload) and isinstance(ctx, PowerSGDContext)
        out = c.combine([payload], ctx)
        held.append((out, out.clone()))
        for plan in ctx.plans:
            if plan.basis is None:
                continue
            m = x[plan.start : plan.start + plan.numel].view(plan.rows, plan.cols)
            size = plan.factor_rows * plan.rank
            f = payload.factors[plan.offset : plan.offset + size].view(plan.factor_rows, -1)
            b = plan.basis
            if plan.side == LEFT:
                assert torch.equal(f, m @ b)
                approx = f @ b.t()
            else:
                k = plan.rows
                gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
                bound = gamma * (m.double().abs().t() @ b.double().abs())
                assert ((f.double() - m.double().t() @ b.double()).abs() <= bound).all()
                approx = b @ f.t()
            assert torch.equal(out[plan.start : plan.start + plan.numel].view_as(m), approx)
    for out, kept in held:
        assert torch.equal(out, kept)
