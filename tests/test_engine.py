"""The step engine (gravac.engine) below the front ends: compressor statistics that lag a step,
and the residual update settled before the send.

The 16-bit casts scale by the largest magnitude over ranks; under error feedback the engine
agrees it with the step's scalars and the next step uses it (no blocking collective before the
cast), with 16x headroom; a larger jump is clamped and the excess kept in the residual.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from gravac import GravacOptimizer, compressors
from gravac.compressors.base import Round
from gravac.compressors.sparse import BREAK_EVEN_CF
from gravac.config import build_engine
from gravac.control.records import Decision, Plan
from gravac.engine import Engine, Given, Lent, Step, Unit

#: fp16's largest finite value
FP16_MAX = 65504.0


@pytest.mark.parametrize("m", [1e-3, 1.0, 3.0, 700.0])
def test_a_stale_maximum_leaves_sixteen_times_headroom(m: float) -> None:
    c = compressors.create("fp16")
    x = torch.tensor([m, -m / 2])
    agreed = torch.tensor([m])
    fresh = c.exponent(x, Round(world_size=2, agreed=agreed))
    stale = c.exponent(x, Round(world_size=2, agreed=agreed, stale=True))
    assert stale == fresh - 4
    # the largest value lands in (M/4, M/2]: the sum of the ranks' values has room to round
    assert math.ldexp(16 * m, stale) <= FP16_MAX / 2 < math.ldexp(16 * m, stale + 1)


def single(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp16 with error feedback on one parameter, one process: the aggregate (what was sent)
    and the residual after each step of the given gradients."""
    p = torch.nn.Parameter(torch.zeros(2, 4))
    opt = GravacOptimizer(torch.optim.SGD([p], lr=0.0), compressor="fp16", overlap=False)
    sent, residuals = [], []
    for g in grads:
        p.grad = g.clone()
        opt.synchronize()
        sent.append(p.grad.detach().clone())
        e = opt.memory.residual(0)
        assert e is not None
        residuals.append(e.reshape(p.shape).clone())
        opt.step()
    return sent, residuals


def test_a_jump_beyond_the_headroom_is_clamped_into_the_residual_and_sent_next() -> None:
    ones = torch.ones(2, 4)
    jump = ones.clone()
    jump[0, 0] = 1e4  # 10^4 times the agreed maximum of 1
    sent, residuals = single([ones, jump, torch.zeros(2, 4)])
    assert torch.equal(sent[0], ones) and torch.equal(residuals[0], torch.zeros(2, 4))
    # step 1 scales for 16 x 1: 2^10, and each value is clamped to (65504 / 2) / 2^10
    clamp = FP16_MAX / 2**11
    assert sent[1][0, 0] == clamp and torch.equal(sent[1].flatten()[1:], ones.flatten()[1:])
    assert residuals[1][0, 0] == 1e4 - clamp
    assert torch.equal(jump + residuals[0], sent[1] + residuals[1])  # error feedback exact
    # step 2 scales for the agreed 10^4: the excess goes out
    assert sent[2][0, 0] == pytest.approx(1e4 - clamp, rel=1e-3)
    assert torch.equal(residuals[1], sent[2] + residuals[2])


def test_without_error_feedback_the_maximum_is_agreed_at_every_step() -> None:
    """Nothing would keep what a stale scale clamps: fresh statistics, nothing clamped."""
    p = torch.nn.Parameter(torch.zeros(3))
    p2 = torch.nn.Parameter(torch.zeros(2, 2))
    opt = GravacOptimizer(
        torch.optim.SGD([p, p2], lr=0.0), compressor="fp16", error_feedback=False, overlap=False
    )
    for value in (1.0, 1e4):
        p2.grad = torch.full((2, 2), value)
        opt.synchronize()
        assert torch.equal(p2.grad, torch.full((2, 2), value))
        opt.step()


def launch_one(compressor: str, *, complete: bool) -> tuple[Engine, Step, torch.Tensor]:
    """One unit of a 4 x 8 gradient launched on one process at a fixed CF, after a first step
    that leaves a residual; returns the engine, the launched step and the gradient."""
    engine = build_engine(compressor=compressor, policy="fixed", policy_options={"cf": 4})
    unit = Unit(key=0, shapes=(torch.Size([4, 8]),), compressed=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        g = torch.randn(32, generator=gen)
        step = engine.begin()
        engine.launch(step, unit, g.clone(), complete=complete)
        if engine.memory.residual(0) is None:  # the first step: commit it, launch another
            engine.close(step).wait()
            engine.finish(engine.commit(step))
    return engine, step, g


@pytest.mark.parametrize("compressor", ["topk", "fp16", "thc"])
def test_the_residual_is_settled_before_the_send_and_kept_at_commit(compressor: str) -> None:
    """Where every tensor has a gradient, ``e <- x - D(sent)`` is computed at launch (so an
    all-reduce may sum into the payload itself) but becomes the residual only at commit."""
    engine, step, g = launch_one(compressor, complete=True)
    old = engine.memory.residual(0)
    assert old is not None
    old = old.clone()
    (flight,) = step.flights
    assert flight.residual is not None and flight.sent is not None
    sent = engine.compressor.decompress(*flight.sent).reshape(-1)
    assert torch.equal(flight.residual, g + old - sent)  # error feedback, bit for bit
    assert torch.equal(engine.memory.residual(0), old)  # not yet kept
    engine.close(step).wait()
    engine.finish(engine.commit(step))
    assert engine.memory.residual(0) is flight.residual


def test_a_unit_with_a_missing_gradient_updates_its_residual_at_commit() -> None:
    """A tensor may have a gradient on no rank (its residual must stay): that is known only
    from the agreed flags, so such a unit keeps ``x`` until commit."""
    _, step, _ = launch_one("topk", complete=False)
    assert step.flights[0].residual is None


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_sixteen_bit_cast_skips_a_non_finite_gradient_its_statistics_show(value: float) -> None:
    """fp16 clamps what it sends, so its aggregate would hide an Inf: the largest magnitude it
    computes anyway for its scale is the step's non-finite check."""
    p = torch.nn.Parameter(torch.zeros(2, 4))
    opt = GravacOptimizer(torch.optim.SGD([p], lr=1.0), compressor="fp16", overlap=False)
    p.grad = torch.ones(2, 4)
    opt.step()
    before = p.detach().clone()
    p.grad = torch.ones(2, 4)
    p.grad[1, 2] = value
    with pytest.warns(RuntimeWarning, match="skipped step 1: .* the wrapped optimizer did not"):
        opt.step()
    assert opt.skipped_steps == 1 and torch.equal(p.detach(), before)


@pytest.mark.parametrize(
    "compressor",
    ["topk", "redsync", "dgc", "randomk", "topkc", "fp16", "bf16", "thc", "powersgd"],
)
@pytest.mark.parametrize("cf", [1.0, 4.0])
def test_a_gradient_packed_with_its_residual_gives_the_same_steps(
    compressor: str, cf: float
) -> None:
    """``x = g + e`` written as the gradient is packed (``Engine.addend``, ``packed=True``):
    the same aggregates and residuals, bit for bit, as the engine's own compensation, through
    a skipped step too; every memory that keeps only a residual packs from its second step
    (DGC's memory keeps momentum too: never)."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(32, generator=gen) for _ in range(5)]
    grads[3][2] = math.inf
    packed = through_engine(compressor, cf, grads, own=True, pack=True)
    assert_same_steps(packed, through_engine(compressor, cf, grads, own=True))
    # a dense send (CF 1) leaves no residual to add
    assert packed[3] == ([] if compressor == "dgc" or cf == 1.0 else [1, 2, 3, 4])


def test_only_a_complete_compressed_unit_without_carry_or_tracking_is_packed() -> None:
    """``addend`` is ``None`` wherever ``launch`` compensates otherwise, and a packed launch
    that the engine would not pack is refused."""
    grads = [torch.ones(8), torch.ones(8)]
    unit = Unit(key=0, shapes=(torch.Size([2, 4]),), compressed=True)
    engine = build_engine(compressor="topk", policy="fixed", policy_options={"cf": 4.0})
    step = engine.begin()
    assert engine.addend(step, unit, grads[0]) is None  # no residual yet
    engine.launch(step, unit, grads[0].clone())
    engine.close(step).wait()
    engine.finish(engine.commit(step))
    step = engine.begin()
    e = engine.addend(step, unit, grads[1])
    assert e is not None and torch.equal(e, engine.memory.residual(0))
    assert engine.addend(step, unit, grads[1], complete=False) is None
    assert engine.addend(step, unit, grads[1], carry=True) is None
    dense = Unit(key=-1, shapes=(torch.Size([8]),), compressed=False)
    assert engine.addend(step, dense, grads[1]) is None
    with pytest.raises(ValueError, match="packed=True"):
        engine.launch(step, unit, grads[1], Given(packed=True), complete=False)
    with pytest.raises(ValueError, match="packed=True"):
        engine.launch(step, unit, grads[1], Given(packed=True), carry=torch.zeros(8))
    accordion = build_engine(compressor="topk", policy="accordion")
    step = accordion.begin()
    assert step.plan.norms  # Accordion sums each gradient alone
    assert accordion.addend(step, unit, grads[1]) is None


Steps = tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, int, int]], list[int]]


def assert_same_steps(mine: Steps, theirs: Steps) -> None:
    """The same aggregates (NaN where a step is skipped) and residuals, bit for bit."""
    for a, b in zip(mine[0], theirs[0], strict=True):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())
    assert all(torch.equal(a, b) for a, b in zip(mine[1], theirs[1], strict=True))


def through_engine(
    compressor: str, cf: float, grads: list[torch.Tensor], *, own: bool, pack: bool = False
) -> Steps:
    """One 4 x 8 unit on one process, its buffer handed over as the optimizer does with
    ``own``: the buffer kept after a step is the aggregate's; with ``pack``, the residual is
    added as the gradient is written into it (``Engine.addend``). Returns each step's aggregate
    and residual, the storage of the buffer given, the aggregate and the residual, and the
    steps packed. CF 1: the unit is sent dense (an Algorithm-1 decision)."""
    engine = build_engine(compressor=compressor, policy="fixed", policy_options={"cf": 4.0})
    unit = Unit(key=0, shapes=(torch.Size([4, 8]),), compressed=True)
    buf = torch.empty(32)
    means, residuals, ptrs, packed = [], [], [], []
    for i, g in enumerate(grads):
        step = engine.begin()
        if cf == 1.0:
            step.decision = Decision(cf=1.0, which="dense")
        e = engine.addend(step, unit, buf) if pack else None
        if e is None:
            buf.copy_(g)
        else:
            torch.add(g, e, out=buf)
            packed.append(i)
        given = buf.untyped_storage().data_ptr()
        handover = Given(packed=e is not None) if own else Lent(out=buf)
        future = engine.launch(step, unit, buf, handover)
        engine.close(step).wait()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
            outcome = engine.commit(step)
        engine.finish(outcome)
        mean = future.value()
        e = engine.memory.residual(0)
        e = torch.zeros(32) if e is None else e
        means.append(mean.clone())
        residuals.append(e.clone())
        ptrs.append((given, mean.untyped_storage().data_ptr(), e.untyped_storage().data_ptr()))
        buf = outcome.grads[0] if not outcome.skipped else buf
    return means, residuals, ptrs, packed


@pytest.mark.parametrize(
    "compressor",
    ["topk", "redsync", "dgc", "randomk", "topkc", "fp16", "bf16", "thc", "powersgd"],
)
@pytest.mark.parametrize("cf", [1.0, 4.0])  # 1: sent dense
def test_a_buffer_handed_over_gives_the_same_steps_and_swaps_with_the_residual(
    compressor: str, cf: float
) -> None:
    """``launch`` with :class:`Given` (the optimizer's): the same aggregates and residuals, bit for
    bit, as with a buffer the engine leaves alone, through a skipped step (NaN) too; from the
    second compressed step on, the residual is the buffer given and the aggregate lands in the
    old residual's storage (no third buffer); a dense send (CF 1) sums the buffer in place."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(32, generator=gen) for _ in range(5)]
    grads[3][7] = math.nan
    mine, theirs = (through_engine(compressor, cf, grads, own=own) for own in (True, False))
    assert_same_steps(mine, theirs)
    ptrs = mine[2]
    if cf == 1.0:
        assert all(mean == given for given, mean, _ in ptrs)
        return
    for t in (1, 2, 4):  # step 3 is skipped: its residual stays the one before
        given, mean, residual = ptrs[t]
        assert residual == given and mean == ptrs[t - 1 if t != 4 else 2][2]


#: the 4 x 8 unit's elements in a buffer of 40 that holds other tensors (marked OTHER) before,
#: between and after them, as a DDP bucket interleaves weights with biases
PLACE_SPANS = ((2, 14), (20, 40))
OTHER = -7.0


def placed_through_engine(compressor: str, cf: float, grads: list[torch.Tensor]) -> Steps:
    """``through_engine(own=True, pack=True)`` with the aggregate laid into the spans of a
    larger buffer (``Given(place=...)``, the DDP hook's): each step's aggregate is read
    back from the spans; checks that the rest of the buffer is left alone."""
    engine = build_engine(compressor=compressor, policy="fixed", policy_options={"cf": 4.0})
    unit = Unit(key=0, shapes=(torch.Size([4, 8]),), compressed=True)
    bucket = torch.full((41,), OTHER)
    inside = torch.zeros(41, dtype=torch.bool)
    for a, b in PLACE_SPANS:
        inside[a:b] = True
    buf = torch.empty(32)
    means, residuals, packed = [], [], []
    for i, g in enumerate(grads):
        step = engine.begin()
        if cf == 1.0:
            step.decision = Decision(cf=1.0, which="dense")
        e = engine.addend(step, unit, buf)
        if e is None:
            buf.copy_(g)
        else:
            torch.add(g, e, out=buf)
            packed.append(i)
        given = Given(packed=e is not None, place=(bucket, PLACE_SPANS))
        future = engine.launch(step, unit, buf, given)
        engine.close(step).wait()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
            outcome = engine.commit(step)
        engine.finish(outcome)
        means.append(future.value().clone() if outcome.skipped else bucket[inside].clone())
        assert bool((bucket[~inside] == OTHER).all())
        e = engine.memory.residual(0)
        residuals.append((torch.zeros(32) if e is None else e).clone())
        buf = outcome.grads[0] if not outcome.skipped else buf
        assert buf.numel() == 32
    return means, residuals, [], packed


@pytest.mark.parametrize(
    "compressor",
    ["topk", "redsync", "dgc", "randomk", "topkc", "fp16", "bf16", "thc", "powersgd"],
)
@pytest.mark.parametrize("cf", [1.0, 4.0])  # 1: sent dense
def test_an_aggregate_laid_into_spans_is_the_flat_one(compressor: str, cf: float) -> None:
    """``Given(place=(buffer, spans))``: bit for bit the aggregates and residuals of a flat
    launch, through a skipped step too, in the spans and nowhere else; what the future gives
    back is a buffer of the unit's size for the next launch."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(32, generator=gen) for _ in range(5)]
    grads[3][7] = math.nan
    mine = placed_through_engine(compressor, cf, grads)
    theirs = through_engine(compressor, cf, grads, own=True, pack=True)
    assert_same_steps(mine, theirs)
    assert mine[3] == theirs[3]  # the same steps packed


def test_a_place_of_another_size_is_refused() -> None:
    engine = build_engine(compressor="topk", policy="fixed", policy_options={"cf": 4.0})
    unit = Unit(key=0, shapes=(torch.Size([4, 8]),), compressed=True)
    step = engine.begin()
    with pytest.raises(ValueError, match=r"spans of the unit's 32 elements, got \(\(0, 31\),\)"):
        engine.launch(step, unit, torch.zeros(32), Given(place=(torch.zeros(40), ((0, 31),))))


def _one_step(engine: Engine, unit: Unit, g: torch.Tensor, plan: Plan | None = None) -> Step:
    """Launch, close and commit one step of ``unit`` with gradient ``g`` (``plan``: in place of
    the controller's); the step, its flights kept."""
    step = engine.begin()
    if plan is not None:
        step.plan = plan
    engine.launch(step, unit, g.clone())
    engine.close(step).wait()
    engine.finish(engine.commit(step))
    return step


@pytest.mark.parametrize("compressor", ["topk", "dgc", "redsync"])
@pytest.mark.parametrize("cf", [1.0, 1.5, 2.0, 2.5])
def test_a_sparsifier_at_or_below_its_break_even_sends_the_tensor_dense(
    compressor: str, cf: float
) -> None:
    """Values and int32 indices of float32 gradients are no fewer bytes than the tensor at a CF
    of 2 or less: such a CF is planned, sent and logged as CF 1, the tensor all-reduced as it
    is, nothing kept in the residual. Above it, the payload is sparse."""
    engine = build_engine(compressor=compressor, policy="fixed", policy_options={"cf": cf})
    unit = Unit(key=0, shapes=(torch.Size([16, 8]),), compressed=True)
    g = torch.randn(128, generator=torch.Generator().manual_seed(0))
    engine.memory.compensate(0, torch.zeros(128))  # a residual of zeros: the step's x is g
    step = _one_step(engine, unit, g)
    (flight,) = step.flights
    record = engine.last_record
    assert record is not None
    if cf <= BREAK_EVEN_CF:
        assert step.plan.cf == 1.0 and step.decision == Decision(cf=1.0, which="dense")
        assert flight.dense and flight.wire_bytes == 4 * 128
        assert torch.equal(flight.result.value().reshape(-1), g)
        residual = engine.memory.residual(0)
        assert residual is None or not residual.any()
        assert (record.cf_sent, record.sent, record.wire_bytes) == (1.0, "dense", 4 * 128)
    else:
        assert step.plan.cf == cf and not flight.dense
        assert flight.wire_bytes == 8 * round(128 / cf)
        assert record.cf_sent == cf and record.sent == "min"


def test_a_layer_at_or_below_the_break_even_is_a_dense_piece_beside_sparse_ones() -> None:
    """Per-layer CFs (Accordion's regimes): the tensors planned at CF 1 under a sparsifier go
    dense through the all-reduce, the others as Top-k pieces; each piece's residual follows
    what it sent (zero for the dense one), bit for bit."""
    engine = build_engine(compressor="topk", policy="accordion")
    unit = Unit(key=0, shapes=(torch.Size([8, 4]), torch.Size([10, 10])), compressed=True)
    first, second = unit.layer_ids
    g = torch.randn(132, generator=torch.Generator().manual_seed(1))
    plan = engine.begin().plan
    per_layer = dataclasses.replace(plan, layer_cfs={first: 1.0, second: 10.0}, per_layer=True)
    step = _one_step(engine, unit, g, per_layer)
    (flight,) = step.flights
    dense, sparse = flight.pieces
    assert isinstance(dense.by, compressors.create("none").__class__)
    assert dense.by.collective == "allreduce" and sparse.by is engine.compressor
    assert flight.wire_bytes == 4 * 32 + 8 * 10
    aggregate = flight.result.value().reshape(-1)
    assert torch.equal(aggregate[:32], g[:32])
    kept = aggregate[32:] != 0
    assert int(kept.sum()) == 10 and torch.equal(aggregate[32:][kept], g[32:][kept])
    residual = engine.memory.residual(0)
    assert residual is not None
    assert not residual[:32].any()
    assert torch.equal(residual[32:] + aggregate[32:], g[32:])


def test_accordion_sends_powersgd_at_one_rank_per_regime_whatever_the_shapes() -> None:
    """Accordion with PowerSGD plans ranks, not CFs (4 critical, 1 otherwise, by default, as the
    GraVAC paper ran it): every layer of a regime at its rank, layers of different shapes and
    regimes in pieces of their own; before any regime is known, the whole unit at rank 4."""
    engine = build_engine(compressor="powersgd", policy="accordion")
    shapes = (torch.Size([32, 16]), torch.Size([24, 40]), torch.Size([16, 16]))
    unit = Unit(key=0, shapes=shapes, compressed=True)
    a, b, c = unit.layer_ids
    g = torch.randn(unit.numel, generator=torch.Generator().manual_seed(2))
    step = _one_step(engine, unit, g)
    (flight,) = step.flights
    assert flight.sent is not None and not flight.pieces
    assert [p.rank for p in flight.sent[1].plans] == [4, 4, 4]
    plan = engine.begin().plan
    assert plan.rank == 4 and plan.per_layer
    regimes = dataclasses.replace(plan, layer_ranks={a: 4, b: 1, c: 1})
    (flight,) = _one_step(engine, unit, g, regimes).flights
    assert [[p.rank for p in piece.ctx.plans] for piece in flight.pieces] == [[4], [1, 1]]
    record = engine.last_record
    assert record is not None and record.cf_sent == record.cf_achieved > 1.0


def test_accordion_ranks_are_refused_for_a_compressor_that_sends_at_none() -> None:
    with pytest.raises(ValueError, match="low_rank and high_rank need a compressor that sends at"):
        build_engine(compressor="topk", policy="accordion", policy_options={"low_rank": 4})
