"""The DDP comm hook (gravac.ddp) on real gloo process groups: the same results as the
optimizer front end, non-finite steps, bucket rebuilds and checkpoints."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gravac import GravacOptimizer
from gravac.control.tables import cf_key
from gravac.ddp import GravacHookState, gravac_hook
from tests.helpers import (
    SMALL_BUDGETS,
    batch,
    counter_clock,
    sample_budgets,
    through_torch_save,
    tiny_model,
)
from tests.workers import Workers

pytestmark = pytest.mark.slow
STEPS = 10
SPAWN_TIMEOUT = 240.0


def options(compressor: str, search: str = "trial") -> dict[str, Any]:
    return {
        "compressor": compressor,
        "search": search,
        "window": 3,
        "warmup_steps": 2,
        "clock": counter_clock(),
    }


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def hooked(
    model: nn.Module, compressor: str, search: str = "trial", **ddp: Any
) -> tuple[nn.Module, GravacHookState]:
    net = DistributedDataParallel(model, **ddp)
    state = GravacHookState(**options(compressor, search))
    net.register_comm_hook(state, gravac_hook)
    return net, state


def fit(net: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def hook_and_optimizer(
    rank: int,
    world_size: int,
    compressor: str,
    bucket_view: bool = False,
    search: str = "trial",
    budgets: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Train the same model with the optimizer front end and with the DDP hook (the
    gradients views of DDP's buckets with ``bucket_view``), the search's samples under
    ``budgets`` (:func:`tests.helpers.sample_budgets`; ``None``: the real ones)."""
    with sample_budgets(budgets):
        return _hook_and_optimizer(rank, world_size, compressor, bucket_view, search)


def _hook_and_optimizer(
    rank: int, world_size: int, compressor: str, bucket_view: bool, search: str
) -> dict[str, Any]:
    a = tiny_model(seed=0)
    opt_a = GravacOptimizer(sgd(a), **options(compressor, search))
    records_a = []
    for step in range(STEPS):
        fit(a, opt_a, rank, range(step, step + 1))
        records_a.append(opt_a.last_record)
    b = tiny_model(seed=0)
    net, state = hooked(b, compressor, search, gradient_as_bucket_view=bucket_view)
    opt_b = sgd(b)
    records_b = []
    for step in range(STEPS):
        fit(net, opt_b, rank, range(step, step + 1))
        records_b.append(state.engine.last_record)
    decisions = [
        [
            (r.cf_sent, r.sent, r.theta_min, r.cf_candidate, r.gain_shadow, r.signal)
            for r in recs
            if r is not None
        ]
        for recs in (records_a, records_b)
    ]
    ctl = state.engine.controller
    return {
        "params_a": [p.detach().clone() for p in a.parameters()],
        "params_b": [p.detach().clone() for p in b.parameters()],
        "decisions_a": decisions[0],
        "decisions_b": decisions[1],
        "wire": (opt_a.total_wire_bytes, state.engine.total_wire_bytes),
        "strides": [(e.windows.stride, e.shadows.stride) for e in (opt_a.engine, state.engine)],
        # every CF the hook's controller holds is one its compressor delivers (PowerSGD's
        # depend on the model's shapes, bound from the second step on)
        "deliverable_b": all(
            cf_key(state.engine.compressor.deliverable_cf(cf, world_size)) == cf
            for cf in [ctl.windows.theta_min, *ctl.windows.smoothed.gain]
        ),
    }


@pytest.mark.parametrize(
    ("bucket_view", "search", "budgets"),
    [
        (False, "trial", None),
        (True, "trial", None),
        (True, "shadow", None),
        (True, "shadow", SMALL_BUDGETS),  # as a model of more than 64M elements
    ],
)
def test_the_hook_trains_exactly_as_the_optimizer_with_topk(
    bucket_view: bool, search: str, budgets: tuple[int, int] | None, gloo_pools: Workers
) -> None:
    results = gloo_pools.run(
        hook_and_optimizer, 2, "topk", bucket_view, search, budgets, timeout=SPAWN_TIMEOUT
    )
    strides = (16, 64) if budgets is None else (128, 512)
    assert all(r["strides"] == [strides, strides] for r in results)
    if search == "shadow":
        assert any(d[4] for d in results[0]["decisions_b"])  # shadow gains were measured
        assert any(d[5] is not None for d in results[0]["decisions_b"])  # and signal shares
    for r in results:
        assert r["decisions_a"] == r["decisions_b"]
        assert len(r["decisions_b"]) == STEPS
        assert r["wire"][0] == r["wire"][1]
        for pa, pb in zip(r["params_a"], r["params_b"], strict=True):
            assert torch.equal(pa, pb)
    for pa, pb in zip(results[0]["params_b"], results[1]["params_b"], strict=True):
        assert torch.equal(pa, pb)  # the ranks stay identical


@pytest.mark.parametrize("compressor", ["thc", "powersgd", "randomk", "fp16"])
def test_the_hook_keeps_ranks_identical(compressor: str, gloo_pools: Workers) -> None:
    results = gloo_pools.run(hook_and_optimizer, 2, compressor, timeout=SPAWN_TIMEOUT)
    assert results[0]["decisions_b"] == results[1]["decisions_b"]
    assert results[0]["deliverable_b"]
    for pa, pb in zip(results[0]["params_b"], results[1]["params_b"], strict=True):
        assert torch.equal(pa, pb)
        assert bool(torch.isfinite(pa).all())


def nan_on_one_rank(rank: int, world_size: int, bucket_view: bool) -> dict[str, Any]:
    """Rank 1 alone has a NaN gradient at step 2: every rank gets NaN gradients (so that
    GradScaler skips everywhere), and the hook's residuals and counters stay as they were; the
    warning says what the NaN gradients do."""
    model = tiny_model(seed=0)
    net, state = hooked(model, "topk", gradient_as_bucket_view=bucket_view)
    out: dict[str, Any] = {}
    for step in range(4):
        net.zero_grad()
        x, y = batch(rank, step)
        if step == 2 and rank == 1:
            x[0, 0, 0, 0] = float("nan")
        kept = {k: v.clone() for k, v in state.engine.memory.residuals.items()}  # type: ignore[attr-defined]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nn.functional.cross_entropy(net(x), y).backward()
        if step == 2:
            out["warnings"] = [str(w.message) for w in caught]
            grads = [p.grad for p in model.parameters()]
            out["all_nan"] = all(bool(torch.isnan(g).all()) for g in grads if g is not None)
            now = state.engine.memory.residuals  # type: ignore[attr-defined]
            out["residuals_kept"] = kept.keys() == now.keys() and all(
                torch.equal(kept[k], now[k]) for k in kept
            )
    out["steps"], out["skipped"] = state.engine.steps, state.engine.skipped_steps
    return out


@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_nonfinite_gradient_on_one_rank_gives_nan_on_every_rank(
    bucket_view: bool, gloo_pools: Workers
) -> None:
    for r in gloo_pools.run(nan_on_one_rank, 2, bucket_view, timeout=SPAWN_TIMEOUT):
        assert r["all_nan"] and r["residuals_kept"]
        assert (r["steps"], r["skipped"]) == (3, 1)
        (message,) = r["warnings"]
        assert message.startswith("gravac skipped step 2") and "become NaN" in message


class Lookup(nn.Module):
    """An ``nn.Embedding(sparse=True)`` (registered first: DDP's sparse bucket is its last at
    the first step, its first after the rebuild) under a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).mean(1))


def sparse_embedding(rank: int, world_size: int, compressor: str) -> dict[str, Any]:
    """SparseAdam on the embedding and SGD on the head, through plain DDP and through gravac's
    hook with ``compressor``: the final parameters of each, and whether every embedding
    gradient the optimizers saw was sparse."""
    out: dict[str, Any] = {}
    for front in ("ddp", "hook"):
        model = Lookup()
        net = DistributedDataParallel(model)
        if front == "hook":
            net.register_comm_hook(GravacHookState(**options(compressor)), gravac_hook)
        opts = [
            torch.optim.SparseAdam([model.emb.weight], lr=0.05),
            torch.optim.SGD(model.head.parameters(), lr=0.1),
        ]
        sparse = []
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * rank + step)
            idx = torch.randint(0, 50, (8, 5), generator=gen)
            y = torch.randint(0, 3, (8,), generator=gen)
            for o in opts:
                o.zero_grad()
            nn.functional.cross_entropy(net(idx), y).backward()
            sparse.append(model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse)
            for o in opts:
                o.step()
        out[front] = {"params": [p.detach().clone() for p in model.parameters()], "sparse": sparse}
    return out


@pytest.mark.parametrize("compressor", ["none", "topk"])
def test_sparse_gradients_travel_as_sparse_rows_as_ddp_sends_them(
    compressor: str, gloo_pools: Workers
) -> None:
    """SparseAdam trains through the hook: the embedding's gradient stays sparse and is
    averaged as DDP's own sparse all-reduce averages it. Uncompressed (``none``, whose dense
    buckets are DDP's average too on 2 ranks) the run is DDP's bit for bit; under Top-k the
    head is compressed and the ranks stay identical."""
    results = gloo_pools.run(sparse_embedding, 2, compressor, timeout=SPAWN_TIMEOUT)
    for r in results:
        assert all(r["ddp"]["sparse"]) and all(r["hook"]["sparse"])
        if compressor == "none":
            for a, b in zip(r["ddp"]["params"], r["hook"]["params"], strict=True):
                assert torch.equal(a, b)
    for a, b in zip(results[0]["hook"]["params"], results[1]["hook"]["params"], strict=True):
        assert torch.equal(a, b)  # the ranks stay identical


def conservation(rank: int, world_size: int) -> dict[str, Any]:
    """One rank, small DDP buckets that DDP rebuilds after the first step: error feedback
    loses nothing, sum of gradients == sum of what was applied + the residuals left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 10))
    net, state = hooked(model, "topk", bucket_cap_mb=0.02)
    grads_sum = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    applied_sum = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    keys_seen = set()
    for step in range(6):
        net.zero_grad()
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        local = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
        net(x).square().mean().backward()
        for s, g in zip(grads_sum, local, strict=True):
            s += g.double()
        for s, p in zip(applied_sum, model.parameters(), strict=True):
            s += p.grad.double()  # type: ignore[union-attr]
        keys_seen |= set(state.engine.memory.residuals)  # type: ignore[attr-defined]
    left = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for key, params in state._units.items():
        e = state.engine.memory.residual(key)
        if e is None:
            continue
        offset = 0
        for p in params:
            left[index[id(p)]] += e[offset : offset + p.numel()].view(p.shape).double()
            offset += p.numel()
    for p in model.parameters():
        if id(p) in state._orphans:  # retired, not yet added to a new unit
            left[index[id(p)]] += state._orphans[id(p)].view(p.shape).double()
    error = max(
        float((g - a - e).abs().max()) for g, a, e in zip(grads_sum, applied_sum, left, strict=True)
    )
    return {"error": error, "keys": sorted(keys_seen), "units": sorted(state._units)}


def test_error_feedback_survives_ddps_bucket_rebuild(gloo_pools: Workers) -> None:
    (r,) = gloo_pools.run(conservation, 1, timeout=SPAWN_TIMEOUT)
    assert r["error"] < 1e-5
    assert len(r["keys"]) > len(r["units"])  # the first buckets were retired by the rebuild


def resume(rank: int, world_size: int, compressor: str) -> dict[str, Any]:
    """10 steps straight against 4 + pickle the state (as a checkpoint) + 6 in a fresh DDP."""
    ref = tiny_model(seed=0)
    net, _ = hooked(ref, compressor)
    opt = sgd(ref)
    fit(net, opt, rank, range(STEPS))
    model = tiny_model(seed=0)
    net, state = hooked(model, compressor)
    opt = sgd(model)
    fit(net, opt, rank, range(4))
    saved = through_torch_save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state}
    )
    model = tiny_model(seed=1)
    model.load_state_dict(saved["model"])
    net = DistributedDataParallel(model)
    restored: GravacHookState = saved["hook"]
    restored.engine.clock = counter_clock()
    net.register_comm_hook(restored, gravac_hook)
    opt = sgd(model)
    opt.load_state_dict(saved["opt"])
    fit(net, opt, rank, range(4, STEPS))
    same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))
    return {"same": same, "steps": restored.engine.steps}


@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_a_pickled_state_resumes_bit_exactly(compressor: str, gloo_pools: Workers) -> None:
    """powersgd: its ranks depend on the model's shapes, which the state carries."""
    for r in gloo_pools.run(resume, 2, compressor, timeout=SPAWN_TIMEOUT):
        assert r["same"] and r["steps"] == STEPS


def test_the_state_pickles_without_the_process_group_monitor_or_clock(tmp_path: Any) -> None:
    state = GravacHookState(compressor="dgc", monitor=str(tmp_path), clock=counter_clock())
    copy = pickle.loads(pickle.dumps(state))
    assert repr(copy.engine.compressor) == repr(state.engine.compressor)
    assert copy.engine.monitor is None and copy.engine.steps == 0


def test_bad_options_name_the_option() -> None:
    with pytest.raises(ValueError, match="theta_min"):
        GravacHookState(theta_min=0.5)
    with pytest.raises(ValueError, match="nonfinite"):
        GravacHookState(nonfinite="ignore")


def mixed_bucket_buffers(rank: int, world_size: int) -> list[tuple[int, int]]:
    """The storage of a mixed bucket's gather buffer and of its unit's residual, per step."""
    model = tiny_model(seed=0)  # weights and biases in one DDP bucket
    net = DistributedDataParallel(model)
    state = GravacHookState(compressor="topk", policy="fixed", policy_options={"cf": 10})
    net.register_comm_hook(state, gravac_hook)
    opt = sgd(model)
    seen = []
    for step in range(4):
        fit(net, opt, rank, range(step, step + 1))
        plan = next(p for p in state._plans.values() if p.spans and p.compressed is not None)
        assert plan.compressed is not None and plan.flats[0] is not None
        residual = state.engine.memory.residual(plan.compressed.key)
        assert residual is not None
        ptrs = (plan.flats[0].untyped_storage().data_ptr(), residual.untyped_storage().data_ptr())
        seen.append(ptrs)
    return seen


def test_a_mixed_bucket_alternates_two_buffers(gloo_pools: Workers) -> None:
    """A bucket of weights and biases is gathered into a buffer of the hook's, handed to the
    engine: from the second step on, that buffer and the residual swap storage every step (no
    new gradient-sized tensor a step)."""
    for seen in gloo_pools.run(mixed_bucket_buffers, 2, timeout=SPAWN_TIMEOUT):
        assert all(seen[t] == seen[t - 1][::-1] for t in (2, 3))


def kept_after_rebuild(rank: int, world_size: int, compressor: str) -> dict[str, Any]:
    """The unit keys alive after DDP's bucket rebuild, and those the compressor keeps state
    or buffers for."""
    model = tiny_model(seed=0)
    net = DistributedDataParallel(model, bucket_cap_mb=0.001)  # a bucket per tensor, rebuilt
    state = GravacHookState(compressor=compressor, policy="fixed", policy_options={"cf": 4})
    net.register_comm_hook(state, gravac_hook)
    fit(net, sgd(model), rank, range(4))
    c = state.engine.compressor
    if compressor == "powersgd":
        kept = set(c._state)  # type: ignore[attr-defined]
    else:
        kept = {k[0][1] for k in c._buffers._buffers if k[0][0] == "payload"}  # type: ignore[attr-defined]
    return {
        "alive": set(state._units),
        "kept": kept,
        "retired": state._next_key > len(state._units),
    }


@pytest.mark.parametrize("compressor", ["fp16", "powersgd"])
def test_a_retired_unit_leaves_no_compressor_state(compressor: str, gloo_pools: Workers) -> None:
    """DDP rebuilds its buckets after the first step: the units of the first buckets are
    retired, and the compressor drops their buffers (a 16-bit payload each) and bases."""
    for out in gloo_pools.run(kept_after_rebuild, 2, compressor, timeout=SPAWN_TIMEOUT):
        assert out["retired"] and out["kept"] and out["kept"] <= out["alive"]
