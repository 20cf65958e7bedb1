"""GravacOptimizer on real gloo process groups of 2 and 4 processes on loopback."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from gravac import GravacOptimizer, broadcast_parameters, compressors, simulate
from gravac.control.searches.sent import MIN_WARMUP_STEPS
from gravac.control.searches.shadow import ShadowController
from gravac.memory import ResidualMemory
from tests.helpers import batch, counter_clock, tiny_model, train_step
from tests.workers import Workers

pytestmark = pytest.mark.slow
STEPS = 12
#: the step at which the aggregate is compared with the simulation (residuals are non-zero)
CHECK_STEP = 7
SPAWN_TIMEOUT = 240.0


#: every registered compressor with its defaults, plus THC's second transport
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (name, {}) for name in compressors.names()},
    **(
        {"thc-allgather": ("thc", {"transport": "allgather"})}
        if "thc" in compressors.names()
        else {}
    ),
}


def make(
    model: torch.nn.Module,
    compressor: str,
    policy: str = "geometric",
    options: dict[str, Any] | None = None,
    bucket_bytes: int = 2**30,  # one bucket for all matrices, so the check below is per bucket
) -> GravacOptimizer:
    return GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        compressor=compressor,
        compressor_options=options,
        policy=policy,
        theta_min=4.0,
        theta_max=64.0,
        window=2,
        warmup_steps=2,
        ewma_alpha=0.5,
        dense_bytes=0,
        bucket_bytes=bucket_bytes,
    )


def train_many(rank: int, world_size: int, variants: dict[str, Any]) -> dict[str, Any]:
    """Train with every compressor variant; record decisions, params, and one aggregate."""
    out: dict[str, Any] = {}
    for label, (name, options) in variants.items():
        model = tiny_model(seed=rank)  # different on purpose: broadcast must fix it
        broadcast_parameters(model)
        opt = make(model, name, options=options)
        cfs, check = [], None
        for step in range(STEPS):
            if step == CHECK_STEP:
                check = _aggregate_check(model, opt, rank, step)
            else:
                train_step(model, opt, rank, step)
            assert opt.last_record is not None
            cfs.append((opt.last_record.cf_sent, opt.last_record.sent))
        out[label] = {
            "cfs": cfs,
            "params": [p.detach().clone() for p in model.parameters()],
            "check": check,
            # plain residual EF and no compressor state: the simulation sees the same inputs
            "comparable": isinstance(opt.memory, ResidualMemory)
            and not opt.compressor.state_dict(),
        }
    return out


def _aggregate_check(
    model: torch.nn.Module, opt: GravacOptimizer, rank: int, step: int
) -> dict[str, Any]:
    """Run one step, returning this rank's x = g + e, the CF sent and the aggregate (the
    gradient read before it is launched: once launched, its buffer is the engine's)."""
    opt.zero_grad()
    xb, yb = batch(rank, step)
    with opt.no_sync():
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
    layout = opt._current_layout()
    (bucket,) = layout.compressed
    g = torch.cat([p.grad.reshape(-1) for p in bucket.params])  # type: ignore[union-attr]
    e = opt.memory.residual(bucket.key)
    x = g + e if e is not None else g.clone()
    opt.step()
    agg = torch.cat([p.grad.reshape(-1) for p in bucket.params])  # type: ignore[union-attr]
    assert opt.last_record is not None
    return {"x": x, "cf": opt.last_record.cf_sent, "sent": opt.last_record.sent, "agg": agg}


@pytest.fixture(scope="module")
def two_ranks(gloo_pools: Workers) -> list[dict[str, Any]]:
    return gloo_pools.run(train_many, 2, VARIANTS, timeout=SPAWN_TIMEOUT)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ranks_take_identical_decisions_and_stay_identical(
    two_ranks: list[dict[str, Any]], name: str
) -> None:
    r0, r1 = two_ranks[0][name], two_ranks[1][name]
    assert r0["cfs"] == r1["cfs"]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in r0["params"])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_aggregate_equals_in_process_simulation(two_ranks: list[dict[str, Any]], name: str) -> None:
    c0, c1 = two_ranks[0][name]["check"], two_ranks[1][name]["check"]
    torch.testing.assert_close(c0["agg"], c1["agg"], rtol=0, atol=0)
    if not two_ranks[0][name]["comparable"]:
        pytest.skip(f"{name} keeps state beyond residuals; its own tests compare with simulation")
    if c0["sent"] == "dense":
        expected = (c0["x"] + c1["x"]) / 2
    else:
        compressor_name, options = VARIANTS[name]
        compressor = compressors.create(compressor_name, **options)
        sim = simulate(compressor, [c0["x"], c1["x"]], c0["cf"], step=CHECK_STEP)
        expected = sim.mean
    torch.testing.assert_close(c0["agg"], expected, rtol=1e-5, atol=1e-6)


def four_rank_run(rank: int, world_size: int) -> dict[str, Any]:
    model = tiny_model(seed=rank)
    broadcast_parameters(model)
    opt = make(model, "topk", policy="exponential")
    cfs = []
    for step in range(16):
        train_step(model, opt, rank, step)
        assert opt.last_record is not None
        cfs.append(opt.last_record.cf_sent)
    return {"cfs": cfs, "params": [p.detach().clone() for p in model.parameters()]}


def test_four_ranks_agree(gloo_pools: Workers) -> None:
    results = gloo_pools.run(four_rank_run, 4, timeout=SPAWN_TIMEOUT)
    for r in results[1:]:
        assert r["cfs"] == results[0]["cfs"]
        for a, b in zip(results[0]["params"], r["params"], strict=True):
            assert torch.equal(a, b)
    assert len(set(results[0]["cfs"])) > 1  # the search really moved


def resume_run(rank: int, world_size: int) -> dict[str, Any]:
    """Train 10 steps straight, and 4 + save + restore into fresh objects + 6: compare."""

    def fresh() -> tuple[torch.nn.Module, GravacOptimizer]:
        model = tiny_model(seed=rank)
        broadcast_parameters(model)
        opt = make(model, "topk", policy="exponential")
        opt.engine.clock = counter_clock()
        return model, opt

    ref_model, ref_opt = fresh()
    for step in range(10):
        train_step(ref_model, ref_opt, rank, step)
    model, opt = fresh()
    for step in range(4):
        train_step(model, opt, rank, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    model, opt = fresh()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    for step in range(4, 10):
        train_step(model, opt, rank, step)
    same = all(
        torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters(), strict=True)
    )
    return {"same": same}


def test_resume_across_two_ranks_is_bit_exact(gloo_pools: Workers) -> None:
    results = gloo_pools.run(resume_run, 2, timeout=SPAWN_TIMEOUT)
    assert all(r["same"] for r in results)


def _refusal(opt: GravacOptimizer, loss: torch.Tensor) -> str:
    """The ValueError's message of ``loss.backward(); opt.step()`` ("" if none)."""
    try:
        loss.backward()
        opt.step()
    except ValueError as exc:
        return str(exc)
    return ""


def sparse_refused(rank: int, world_size: int) -> dict[str, Any]:
    """``nn.Embedding(sparse=True)`` behind a linear layer, wrapped by a GravacOptimizer: the
    refusal each rank raises at the first step (under SparseAdam: the embedding's bucket is
    launched during backward, its gradient ready last), and at the step where the embedding
    joins a run as a new param group (averaged densely otherwise, outside the layout it
    trained on); a barrier after each: no rank was left inside a collective."""
    idx = torch.tensor([1, 2, 2, 5 + rank])
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(30, 8, sparse=True), torch.nn.Linear(8, 8)
    sparse_adam = torch.optim.SparseAdam([*emb.parameters(), *lin.parameters()], lr=0.1)
    first = _refusal(GravacOptimizer(sparse_adam, compressor="topk"), lin(emb(idx)).sum())
    torch.distributed.barrier()
    sparse = emb.weight.grad is not None and emb.weight.grad.is_sparse
    emb.weight.grad = None
    opt = GravacOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), compressor="topk")
    lin(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.add_param_group({"params": emb.parameters()})
    opt.zero_grad()
    joined = _refusal(opt, lin(emb(idx)).sum())
    torch.distributed.barrier()
    # rank 0 alone uses the embedding: rank 1 has no gradient for it at all, and must refuse
    # the step too rather than wait in its collectives for rank 0
    emb.weight.grad = None
    opt.zero_grad()
    one_sided = _refusal(opt, lin(emb(idx) if rank == 0 else torch.randn(4, 8)).sum())
    torch.distributed.barrier()
    opt.zero_grad()  # and the optimizer trains on
    lin(torch.randn(4, 8)).sum().backward()
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in lin.parameters()])
    return {
        "first": first,
        "joined": joined,
        "one_sided": one_sided,
        "sparse": sparse,
        "after": after,
    }


def test_a_sparse_gradient_is_refused_on_every_rank(gloo_pools: Workers) -> None:
    out = gloo_pools.run(sparse_refused, 2, timeout=SPAWN_TIMEOUT)
    for r in out:
        assert r["first"].startswith(
            "parameter 0 (shape (30, 8)) has a gradient of layout torch.sparse_coo on rank(s) "
            "[0, 1] "
        )
        assert r["joined"].startswith(
            "parameter 2 (shape (30, 8)) has a gradient of layout torch.sparse_coo on 2 rank(s)"
        )
        assert r["one_sided"].startswith(
            "parameter 2 (shape (30, 8)) has a gradient of layout torch.sparse_coo on rank(s) [0] "
        )
        assert r["sparse"]
    assert torch.equal(out[0]["after"], out[1]["after"])


def gan(rank: int, world_size: int, pass_through: str, nodes: int = 1) -> dict[str, Any]:
    """A GAN's loop: two optimizers, the generator's loss backpropagated through the
    discriminator. ``pass_through="dropped"``: the discriminator's gradients from it are
    launched and dropped by ``opt_d.zero_grad()``; ``"frozen"``: it is frozen for that pass.
    Both send a static CF (their decisions do not read the clock); ``nodes``: ranks per node
    (two levels where more than 1)."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    disc = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt_g, opt_d = (
        GravacOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            policy="fixed",
            policy_options={"cf": 10},
            ranks_per_node=nodes,
        )
        for m in (gen, disc)
    )
    data = torch.Generator().manual_seed(rank)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    for _ in range(6):
        real, z = torch.randn(16, 16, generator=data) + 2, torch.randn(16, 8, generator=data)
        fake = gen(z)
        opt_d.zero_grad()
        d_loss = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        disc.requires_grad_(pass_through == "dropped")
        bce(disc(fake), torch.ones(16, 1)).backward()
        disc.requires_grad_(True)
        opt_g.step()
    params = torch.cat([p.detach().reshape(-1) for m in (gen, disc) for p in m.parameters()])
    out = {"params": params, "steps": (opt_d.steps, opt_g.steps), "skipped": opt_d.skipped_steps}
    opt_g.close()
    opt_d.close()
    return out


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (4, 2)])
def test_a_backward_through_another_optimizers_parameters_is_dropped_by_its_zero_grad(
    gloo_pools: Workers, world: int, nodes: int
) -> None:
    """The discriminator's gradients from the generator's pass, launched during backward,
    are dropped on every rank by ``zero_grad()``, flat and in two levels: training is bit for
    bit as with the discriminator frozen for that pass (before, the next step raised that a
    gradient changed after its bucket was sent)."""
    dropped = gloo_pools.run(gan, world, "dropped", nodes, timeout=SPAWN_TIMEOUT)
    frozen = gloo_pools.run(gan, world, "frozen", nodes, timeout=SPAWN_TIMEOUT)
    for d, f in zip(dropped, frozen, strict=True):
        assert torch.equal(d["params"], f["params"])
        assert d["steps"] == (6, 6) and d["skipped"] == 0
        assert torch.equal(d["params"], dropped[0]["params"])


def dropped_by_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 zeroes the gradients its backward launched, rank 1 steps them: both raise,
    then train on alike."""
    model = tiny_model(seed=0)
    opt = make(model, "topk")
    train_step(model, opt, rank, 0)
    x, y = batch(rank, 1)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    try:
        if rank == 0:
            opt.zero_grad()
        else:
            opt.step()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    for step in range(2, 5):
        train_step(model, opt, rank, step)
    return {"error": error, "params": [p.detach().clone() for p in model.parameters()]}


def test_a_step_dropped_on_some_ranks_only_raises_on_every_rank(gloo_pools: Workers) -> None:
    out = gloo_pools.run(dropped_by_one_rank, 2, timeout=SPAWN_TIMEOUT)
    for r in out:
        assert r["error"].startswith("rank(s) [0] dropped step 1 (zero_grad() after a backward")
    for a, b in zip(out[0]["params"], out[1]["params"], strict=True):
        assert torch.equal(a, b)


def synchronized_not_stepped(rank: int, world_size: int) -> dict[str, Any]:
    """A step aggregated by synchronize() and then not stepped (a condition skips the
    update), and the loop goes on with plain steps."""
    model = tiny_model(seed=0)
    opt = make(model, "topk")
    for step in range(5):
        if step != 3:  # at step 3 the next backward must drop step 2's pending step alone
            opt.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step in (1, 2):
            opt.synchronize()
            continue
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "steps": opt.steps, "skipped": opt.skipped_steps}


def test_a_synchronized_step_never_stepped_is_dropped_and_ranks_stay_identical(
    gloo_pools: Workers,
) -> None:
    """Before, the next step() stepped the wrapped optimizer on each rank's own gradients
    (the hooks ignored backward while a synchronized step was pending): ranks diverged."""
    out = gloo_pools.run(synchronized_not_stepped, 2, timeout=SPAWN_TIMEOUT)
    for r in out:
        assert r["steps"] == 3 and r["skipped"] == 2
    for a, b in zip(out[0]["params"], out[1]["params"], strict=True):
        assert torch.equal(a, b)


def nan_on_one_rank(
    rank: int, world_size: int, compressor: str, bucket_bytes: int
) -> dict[str, Any]:
    """Rank 1 alone produces a NaN gradient at step 3, its buckets launched during backward
    (rank 0's residuals settled before their sends): every rank must skip that step, residuals
    untouched."""
    model = tiny_model(seed=0)
    opt = make(model, compressor, bucket_bytes=bucket_bytes)
    assert opt.overlap
    skipped, params, residuals = [], [], []
    for step in range(6):
        opt.zero_grad()
        x, y = batch(rank, step)
        if step == 3 and rank == 1:
            x[0, 0, 0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        kept = {k: v.clone() for k, v in opt.memory.residuals.items()}  # type: ignore[attr-defined]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        skipped.append(opt.skipped_steps)
        params.append(
            all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        )
        now = opt.memory.residuals  # type: ignore[attr-defined]
        residuals.append(
            kept.keys() == now.keys() and all(torch.equal(kept[k], now[k]) for k in kept)
        )
    return {
        "skipped": skipped,
        "unchanged": params,
        "residuals": residuals,
        "steps": opt.steps,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


@pytest.mark.parametrize(
    ("compressor", "bucket_bytes"),
    # 4096: the Linear(256, 32) weight split across 8 buckets, launched during backward
    [("topk", 2**30), ("fp16", 2**30), ("topk", 4096), ("dgc", 4096)],
)
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_all(
    compressor: str, bucket_bytes: int, gloo_pools: Workers
) -> None:
    results = gloo_pools.run(nan_on_one_rank, 2, compressor, bucket_bytes, timeout=SPAWN_TIMEOUT)
    assert torch.equal(results[0]["params"], results[1]["params"])
    for r in results:
        assert r["skipped"] == [0, 0, 0, 1, 1, 1]
        assert r["unchanged"] == [False, False, False, True, False, False]
        assert r["residuals"] == [False, False, False, True, False, False]
        assert r["steps"] == 5


def nonfinite_bias_on_one_rank(
    rank: int, world_size: int, compressor: str, value: float
) -> dict[str, Any]:
    """Rank 1 alone has one non-finite element, in a 1-D (dense, uncompressed) gradient, at
    step 2: no rank checks such a gradient locally, the all-reduced sum carries it to all."""
    model = tiny_model(seed=0)
    opt = make(model, compressor)
    bias = next(p for p in model.parameters() if p.dim() == 1)
    skipped, unchanged = [], []
    for step in range(4):
        opt.zero_grad()
        x, y = batch(rank, step)
        hook = None
        if step == 2 and rank == 1:

            def poison(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g[0] = value
                return g

            hook = bias.register_hook(poison)
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if hook is not None:
            hook.remove()
        skipped.append(opt.skipped_steps)
        unchanged.append(
            all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        )
    return {"skipped": skipped, "unchanged": unchanged}


@pytest.mark.parametrize("compressor", ["topk", "none"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_nonfinite_dense_gradient_on_one_rank_skips_the_step_on_all(
    compressor: str, value: float, gloo_pools: Workers
) -> None:
    results = gloo_pools.run(
        nonfinite_bias_on_one_rank, 2, compressor, value, timeout=SPAWN_TIMEOUT
    )
    for r in results:
        assert r == {"skipped": [0, 0, 1, 1], "unchanged": [False, False, True, False]}


def collectives_per_step(rank: int, world_size: int, compressor: str) -> list[list[str]]:
    """Every torch.distributed collective a step issues, in order, for the steps after the
    first (which also compares the ranks' configuration digests)."""
    calls: list[str] = []
    originals = {name: getattr(torch.distributed, name) for name in SPIED}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    model = tiny_model(seed=rank)
    opt = make(model, compressor)
    steps = []
    for step in range(4):
        for name in SPIED:
            setattr(torch.distributed, name, spy(name))
        try:
            train_step(model, opt, rank, step)
        finally:
            for name, fn in originals.items():
                setattr(torch.distributed, name, fn)
        steps.append(list(calls))
        calls.clear()
    return steps[1:]


#: the collectives counted
SPIED = ("all_reduce", "all_gather", "broadcast", "barrier")


#: a step of Top-k: one compressed bucket (values, indices), one dense bucket, the step's scalars
_TOPK_STEP = ["all_gather", "all_gather", "all_reduce", "all_gather"]


@pytest.mark.parametrize(
    ("compressor", "expected"),
    [
        # the step that closes the warm-up's window (the third) adds the window's signal
        # sample over the ranks (gravac.control.noise: the search by shadow, Top-k's)
        ("topk", [_TOPK_STEP, [*_TOPK_STEP, "all_reduce"], _TOPK_STEP]),
        # the payload, the dense bucket, the step's scalars: the 16-bit scale (a max) was
        # agreed with the previous step's scalars (the first step agrees it before the cast);
        # fp16's search is by trial, which measures no signal share
        ("fp16", [["all_reduce", "all_reduce", "all_gather"]] * 3),
    ],
)
def test_a_step_issues_its_payloads_and_one_scalar_gather(
    compressor: str, expected: list[list[str]], gloo_pools: Workers
) -> None:
    """The step's scalars (non-finite flag, step time, gain terms) ride in one all-gather
    beside the payloads: no other collective of the step's own (the old step made two scalar
    all-gathers and a stats all-reduce before the payloads), but for one all-reduce at a
    window's end under the search by shadow."""
    for steps in gloo_pools.run(collectives_per_step, 2, compressor, timeout=SPAWN_TIMEOUT):
        assert steps == expected


def shadow_run(rank: int, world_size: int, horizon: int, warmup: int) -> dict[str, Any]:
    """The search by shadow, its gains over ``horizon`` windows after a warm-up of ``warmup``
    steps, on two ranks with different data, real clocks; rank 1 alone has a NaN gradient at
    step 5, which every rank skips with the shadows untouched."""
    model = tiny_model(seed=rank)
    broadcast_parameters(model)
    opt = GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        compressor="topk",
        policy="exponential",
        search="shadow",
        policy_options={"horizon": horizon},
        theta_min=4.0,
        theta_max=64.0,
        window=2,
        warmup_steps=warmup,
        dense_bytes=0,
    )
    records, untouched = [], True
    for step in range(16):
        opt.zero_grad()
        x, y = batch(rank, step)
        if step == 5 and rank == 1:
            x[0, 0, 0, 0] = float("nan")
        before = opt.engine.shadows.state_dict()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step == 5:
            after = opt.engine.shadows.state_dict()
            tables = [(before[k], after[k]) for k in ("residual", "sent")]
            tables += list(zip(before["earlier"], after["earlier"], strict=True))
            untouched = all(
                a[:3] == b[:3] and torch.equal(a[3], b[3])
                for rows_before, rows_after in tables
                for a, b in zip(rows_before, rows_after, strict=True)
            ) and len(before["residual"]) == len(after["residual"])
        record = opt.last_record
        assert record is not None
        records.append((record.cf_sent, record.gain_shadow, record.signal))
        assert ("signal" in record.scalars()) is (record.signal is not None)  # a TensorBoard tag
    controller = opt.engine.controller
    assert isinstance(controller, ShadowController)
    return {
        "records": records,
        "share": controller.signal_share,
        "untouched": untouched,
        "skipped": opt.skipped_steps,
        "params": [p.detach().clone() for p in model.parameters()],
        "ends": (controller.windows.theta_min, controller.ladder[-1]),
    }


@pytest.mark.parametrize(("horizon", "warmup"), [(1, 2), (2, 2), (2, MIN_WARMUP_STEPS + 1)])
def test_the_search_by_shadow_decides_alike_on_two_ranks(
    horizon: int, warmup: int, gloo_pools: Workers
) -> None:
    """A warm-up long enough for the link model to end it sends the top of the ladder at its
    first and third steps (gravac.control.searches.shadow.TOP_WARMUP_STEPS), a shorter one
    theta_min."""
    r0, r1 = gloo_pools.run(shadow_run, 2, horizon, warmup, timeout=SPAWN_TIMEOUT)
    assert r0["records"] == r1["records"]  # the CFs sent, every shadow gain and signal share
    low, top = r0["ends"]
    first = [cf for cf, _, _ in r0["records"][:3]]
    assert first == ([top, low, top] if warmup >= MIN_WARMUP_STEPS else [low] * 3)
    assert any(gains for _, gains, _ in r0["records"])
    shares = [f for _, _, f in r0["records"] if f is not None]
    assert len(shares) >= 3 and all(0.0 <= f <= 1.0 for f in shares)
    assert r0["share"] == r1["share"] == max(shares)  # the largest so far judges the gains
    assert r0["skipped"] == r1["skipped"] == 1 and r0["untouched"] and r1["untouched"]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


def wrapped_refusals(rank: int, world_size: int) -> list[str]:
    """A GravacOptimizer over a model that torch already distributes: FSDP (1)'s flat
    parameter and FSDP2's DTensors (each rank holding another part), and a DDP model (whose
    all-reduce writes the gradients after gravac sent them). Each error's text, or
    "trained"."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    out = []
    for wrap in ("ddp", "fsdp", "fsdp2"):
        model = tiny_model(seed=0)
        if wrap == "fsdp":
            model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        elif wrap == "fsdp2":
            fully_shard(model)
        else:
            model = DistributedDataParallel(model)
        try:
            opt = GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            for step in range(3):
                train_step(model, opt, rank, step)
            out.append("trained")
        except (ValueError, RuntimeError) as error:
            out.append(str(error))
    return out


def test_a_model_that_torch_distributes_is_refused_by_name_on_every_rank(
    gloo_pools: Workers,
) -> None:
    """gravac averages replicated parameters itself: over FSDP's shards (different on each
    rank) it averaged one rank's part with another's without a word (overlap off) or raised
    that a gradient changed after its bucket was sent (overlap on); over a DDP model it raised
    that, without naming DDP."""
    for errors in gloo_pools.run(wrapped_refusals, 2, timeout=SPAWN_TIMEOUT):
        ddp, flat, dtensor = errors
        assert "flattened and sharded by FullyShardedDataParallel" in flat
        assert "is a DTensor (FSDP2's fully_shard" in dtensor
        assert "changed a gradient" in ddp and "gravac.ddp.gravac_hook" in ddp


def uneven_steps(
    rank: int, world_size: int, overlap: bool, joined: bool, nodes: int = 1, stage: str = "auto"
) -> dict[str, Any]:
    """Rank 0 takes 9 steps, the others run out of data after 5: inside torch's ``Join``
    (``joined``), or as the reference, stepping with no gradient for the last 4 (their
    learning-rate schedule going on); in nodes of ``nodes`` ranks, their stages as ``stage``
    (``node_stage``) moves them. Each rank's parameters and step count."""
    from torch.distributed.algorithms.join import Join

    model = tiny_model(seed=0)
    opt = GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        window=3,
        warmup_steps=2,
        clock=counter_clock(),
        overlap=overlap,
        ranks_per_node=nodes,
        node_stage=stage,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data = 9 if rank == 0 else 5

    def step(i: int) -> None:
        if i < data:
            x, y = batch(rank, i)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    if joined:
        with Join([opt]):
            for i in range(data):
                step(i)
    else:
        for i in range(9):
            step(i)
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": opt.steps}


@pytest.mark.parametrize("overlap", [True, False])
def test_uneven_inputs_under_join_train_as_steps_without_gradients(
    overlap: bool, gloo_pools: Workers
) -> None:
    """Without ``Join`` a rank that ran out of data left the others waiting in a step's
    collectives for the process group's timeout (30 minutes). Under ``Join`` the joined rank
    takes the others' steps with no gradient of its own: bit for bit the run where it steps
    with none, and every rank ends with the parameters of one that trained last."""
    joined = gloo_pools.run(uneven_steps, 2, overlap, True, timeout=SPAWN_TIMEOUT)
    reference = gloo_pools.run(uneven_steps, 2, overlap, False, timeout=SPAWN_TIMEOUT)
    for got in joined:
        assert got["steps"] == 9
        for a, b in zip(got["params"], reference[0]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("stage", ["shm", "collective"])
def test_uneven_inputs_under_join_in_two_levels(stage: str, gloo_pools: Workers) -> None:
    """Two nodes of 2 ranks, rank 0 with 9 batches, the others 5: the joined ranks take part
    in the node's stages of the steps they shadow, through shared memory as through the
    collectives, and every rank ends as in the run where they step with no gradient."""
    joined = gloo_pools.run(uneven_steps, 4, True, True, 2, stage, timeout=SPAWN_TIMEOUT)
    reference = gloo_pools.run(uneven_steps, 4, True, False, 2, stage, timeout=SPAWN_TIMEOUT)
    for got in joined:
        assert got["steps"] == 9
        for a, b in zip(got["params"], reference[0]["params"], strict=True):
            assert torch.equal(a, b)


def uneven_steps_under_the_hook(rank: int, world_size: int) -> dict[str, Any]:
    """As :func:`uneven_steps` through DDP with gravac's hook, inside DDP's own ``Join``."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from gravac.ddp import GravacHookState, gravac_hook

    model = DistributedDataParallel(tiny_model(seed=0))
    state = GravacHookState(window=3, warmup_steps=2, clock=counter_clock())
    model.register_comm_hook(state, gravac_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with Join([model]):
        for i in range(9 if rank == 0 else 5):
            x, y = batch(rank, i)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": state.engine.steps}


def test_uneven_inputs_under_ddps_join_with_the_hook_keep_the_ranks_alike(
    gloo_pools: Workers,
) -> None:
    """DDP's ``Join`` shadows its all-reduces through the comm hook: the engine takes every
    step on both ranks, and they end alike."""
    a, b = gloo_pools.run(uneven_steps_under_the_hook, 2, timeout=SPAWN_TIMEOUT)
    assert a["steps"] == b["steps"] == 9
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)


#: Steps after which a residual of zero gradients under THC at 8 bits (its relative error a
#: step about 2^-8) holds subnormal entries without the flush.
DECAY_STEPS = 40


def decaying_residual(rank: int, world_size: int, compressor: str, cf: float) -> dict[str, Any]:
    """A 256 x 256 weight trained on every row at step 0, then on its first half only: the last
    rows' residual shrinks every step. The most subnormal entries it held after a step, and its
    largest entry at the end."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = GravacOptimizer(
        torch.optim.SGD([w], lr=1e-3),
        compressor=compressor,
        policy="fixed",
        policy_options={"cf": cf},
        dense_bytes=0,
    )
    data = torch.randn(256, 256, generator=torch.Generator().manual_seed(rank))
    tiny = torch.finfo(torch.float32).tiny
    most = 0
    for step in range(DECAY_STEPS):
        opt.zero_grad()
        rows = 256 if step == 0 else 128
        (w[:rows] * data[:rows]).sum().backward()
        opt.step()
        (e,) = opt.memory.residuals.values()  # type: ignore[attr-defined]
        tail = e.view(256, 256)[128:]
        most = max(most, int(((tail != 0) & (tail.abs() < tiny)).sum()))
    return {"subnormal": most, "largest": float(tail.abs().max())}


def test_a_residual_of_zero_gradients_leaves_no_subnormal(gloo_pools: Workers) -> None:
    """Under THC the residual of rows whose gradient is zero shrinks by the compressor's
    relative error every step; it ends at zero through the flush of its subnormal entries
    (float32's slow path on x86), never holding one, on every rank. (PowerSGD's residual_
    flushes alike: ``tests/compressors/test_common.py``.)"""
    for out in gloo_pools.run(decaying_residual, 2, "thc", 4.0, timeout=SPAWN_TIMEOUT):
        assert out["subnormal"] == 0
        assert out["largest"] < 1e-30
