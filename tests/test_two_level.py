"""Two-level aggregation (:mod:`gravac.hierarchy`) on a real gloo group of 4 processes as 2
"nodes" of 2 ranks: the aggregate against the flat one and against the ranks' mean, error
feedback's identity per chunk, ranks deciding alike, and a resume."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gravac import GravacOptimizer, broadcast_parameters
from gravac.ddp import GravacHookState, gravac_hook
from gravac.engine.records import piece_key
from tests.helpers import (
    MOVING_OMEGA,
    SMALL_BUDGETS,
    batch,
    counter_clock,
    sample_budgets,
    through_torch_save,
    tiny_model,
    train_step,
)
from tests.workers import Workers

pytestmark = pytest.mark.slow
SPAWN_TIMEOUT = 240.0
WORLD, NODE = 4, 2
STEPS = 6
#: the static CF of the Top-k runs
CF = 4.0


def model() -> nn.Module:
    """A weight compressed as one bucket (35 elements: chunks of 18 and 17 plus one of
    padding), a bias sent dense."""
    torch.manual_seed(0)
    return nn.Linear(7, 5)


#: the step at which no rank has the weight's gradient
ABSENT = 3


def grads(rank: int, step: int) -> list[torch.Tensor]:
    """Small integers, per rank and step: every mean over ranks or nodes is exact; the
    weight's are zeros (none) at step :data:`ABSENT`."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    out = [torch.randint(-8, 8, s, generator=gen).float() for s in ((5, 7), (5,))]
    if step == ABSENT:
        out[0].zero_()
    return out


def normal_grads(rank: int, step: int) -> list[torch.Tensor]:
    """Standard normal gradients, per rank and step: a 16-bit stage rounds them."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=gen) for s in ((5, 7), (5,))]


def by_hand(
    rank: int,
    world_size: int,
    compressor: str,
    nodes: int,
    precision: str = "fp32",
    by: Callable[[int, int], list[Tensor]] = grads,
) -> dict[str, Any]:
    """``STEPS`` steps of plain SGD (lr 1) on gradients set by hand (``by``),
    ``ranks_per_node=nodes``, ``node_precision=precision``; each step's aggregate, and the
    weight's residual after the last."""
    m = model()
    policy: dict[str, Any] = (
        {"policy": "fixed", "policy_options": {"cf": CF}} if compressor == "topk" else {}
    )
    opt = GravacOptimizer(
        torch.optim.SGD(m.parameters(), lr=1.0),
        compressor=compressor,
        ranks_per_node=nodes,
        node_precision=precision,
        overlap=False,
        clock=counter_clock(),
        **policy,
    )
    aggregates, absent = [], []
    for step in range(STEPS):
        for p, g in zip(m.parameters(), by(rank, step), strict=True):
            p.grad = g
        if step == ABSENT and by is grads:
            m.weight.grad = None
        opt.step()
        aggregates.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in m.parameters()]
        )
        absent.append(m.weight.grad is None)
    residual = opt.memory.residual(0)
    return {
        "aggregates": aggregates,
        "residual": None if residual is None else residual.clone(),
        "absent": absent,
        "topology": str(opt.engine.topology),
    }


def _all_the_mean(
    two: list[dict[str, Any]], flat: list[dict[str, Any]], by: Callable[[int, int], list[Tensor]]
) -> None:
    """Every rank's aggregate at every step, in two levels and flat, is the mean over the
    ranks of their gradients ``by(rank, step)``, bit for bit."""
    for step in range(STEPS):
        each = [by(r, step) for r in range(WORLD)]
        mean = [torch.stack(t).mean(0) for t in zip(*each, strict=True)]
        for r in range(WORLD):
            pairs = zip(two[r]["aggregates"][step], flat[r]["aggregates"][step], strict=True)
            for (a, b), m in zip(pairs, mean, strict=True):
                assert torch.equal(a, m) and torch.equal(b, m)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_levels_send_everything_as_the_flat_mean(gloo_pools: Workers, precision: str) -> None:
    # bfloat16 inside the nodes holds the small integers' halves and quarters exactly
    two = gloo_pools.run(by_hand, WORLD, "none", NODE, precision, timeout=SPAWN_TIMEOUT)
    flat = gloo_pools.run(by_hand, WORLD, "none", 1, timeout=SPAWN_TIMEOUT)
    assert two[0]["topology"] == "2 node(s) of 2 ranks"
    # a weight without a gradient on any rank keeps None: nothing was held back to send
    assert two[0]["absent"] == flat[0]["absent"] == [s == ABSENT for s in range(STEPS)]
    assert flat[0]["topology"] == "flat (4 ranks)"
    _all_the_mean(two, flat, grads)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_four_ranks_a_node_send_everything_as_the_mean(gloo_pools: Workers, precision: str) -> None:
    """One node of all 4 ranks: the weight's 35 elements in chunks of 9, 9, 9 and 8 (one of
    padding), each the peer group of its rank alone."""
    four = gloo_pools.run(by_hand, WORLD, "none", WORLD, precision, timeout=SPAWN_TIMEOUT)
    flat = gloo_pools.run(by_hand, WORLD, "none", 1, timeout=SPAWN_TIMEOUT)
    assert four[0]["topology"] == "1 node(s) of 4 ranks"
    _all_the_mean(four, flat, grads)


def _node_means(step: int) -> list[torch.Tensor]:
    """Each node's mean of the weight's gradient, flat."""
    return [
        torch.stack([grads(n * NODE + i, step)[0] for i in range(NODE)]).mean(0).reshape(-1)
        for n in range(WORLD // NODE)
    ]


def _chunk_residuals(out: list[dict[str, Any]], numel: int = 35) -> Tensor:
    """Each node's residuals of the weight, its ranks' chunks at their places (nodes x
    ``numel``)."""
    residual = torch.zeros(WORLD // NODE, numel)
    for r in range(WORLD):
        node, local = divmod(r, NODE)
        chunk = math.ceil(numel / NODE)
        start, end = min(local * chunk, numel), min((local + 1) * chunk, numel)
        residual[node, start:end] = out[r]["residual"][: end - start]
    return residual


def _ranks_alike(out: list[dict[str, Any]]) -> None:
    """Every rank applied the same aggregates, bit for bit."""
    for r in range(1, WORLD):
        for a, b in zip(out[0]["aggregates"], out[r]["aggregates"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_two_level_topk_keeps_its_bound_and_error_feedback_identity(
    gloo_pools: Workers,
) -> None:
    out = gloo_pools.run(by_hand, WORLD, "topk", NODE, timeout=SPAWN_TIMEOUT)
    _ranks_alike(out)
    # the first step (no residual yet): each node's chunks lose at most 1 - 1/CF of their
    # energy to Top-k, so the mean over nodes is that close to the mean over ranks
    s = _node_means(0)
    mean = torch.stack(s).mean(0)
    agg = out[0]["aggregates"][0][0].reshape(-1)
    bound = (1 - 1 / CF) * sum(float(x @ x) for x in s) / len(s)
    assert 0 < float((agg - mean) @ (agg - mean)) <= bound
    # error feedback per chunk: what was applied plus the nodes' residuals, each at its
    # chunk's place, is every gradient's mean, summed over the steps
    applied = sum(a[0].reshape(-1) for a in out[0]["aggregates"])
    wanted = sum(torch.stack(_node_means(t)).mean(0) for t in range(STEPS))
    residual = _chunk_residuals(out)
    torch.testing.assert_close(applied + residual.mean(0), wanted, rtol=0, atol=1e-5)
    # at the step without the weight's gradient its chunks' residuals were sent, and applied
    assert not out[0]["absent"][ABSENT]
    # the bias (1-D) travels dense in two levels too: the exact mean
    bias = torch.stack([grads(r, STEPS - 1)[1] for r in range(WORLD)]).mean(0)
    assert torch.equal(out[0]["aggregates"][-1][1], bias)


def test_a_16_bit_node_stage_feeds_its_all_gather_rounding_back(gloo_pools: Workers) -> None:
    out = gloo_pools.run(by_hand, WORLD, "topk", NODE, "fp16", normal_grads, timeout=SPAWN_TIMEOUT)
    _ranks_alike(out)
    half = torch.float16
    # every weight aggregate applied went through the node's all-gather in float16
    assert all(torch.equal(a[0], a[0].to(half).float()) for a in out[0]["aggregates"])

    def node_means(step: int) -> list[Tensor]:
        """Each node's mean as its ranks sent it: their gradients halved and rounded to
        float16, summed in float32 (exactly, two of them)."""
        sent = [
            (normal_grads(r, step)[0] / NODE).to(half).float().reshape(-1) for r in range(WORLD)
        ]
        return [sent[2 * n] + sent[2 * n + 1] for n in range(WORLD // NODE)]

    # error feedback's identity over what the nodes reduce-scattered: the all-gather's
    # rounding went into the residuals and is held there, not lost
    applied = sum(a[0].reshape(-1) for a in out[0]["aggregates"])
    wanted = sum(torch.stack(node_means(t)).mean(0) for t in range(STEPS))
    residual = _chunk_residuals(out)
    torch.testing.assert_close(applied + residual.mean(0), wanted, rtol=0, atol=1e-5)


def searched(
    rank: int,
    world_size: int,
    resume_at: int | None,
    budgets: tuple[int, int] | None = None,
    stage: str = "auto",
) -> dict[str, Any]:
    """The default adaptive search in two levels on the tiny CNN: the CFs and parameters after
    20 steps, straight or saved and loaded into fresh objects at ``resume_at``, the search's
    samples under ``budgets`` (:func:`tests.helpers.sample_budgets`; ``None``: the real ones),
    the node's stages as ``stage`` (``node_stage``) moves them."""
    with sample_budgets(budgets):
        return _searched(rank, resume_at, stage)


def _searched(rank: int, resume_at: int | None, stage: str) -> dict[str, Any]:
    m = tiny_model(seed=rank)
    broadcast_parameters(m)

    def make() -> GravacOptimizer:
        return GravacOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            ranks_per_node=NODE,
            theta_min=4.0,
            theta_max=64.0,
            window=3,
            warmup_steps=2,
            omega=MOVING_OMEGA,  # CF 8 from step 7 to 10, across the resume at step 9
            node_stage=stage,
            clock=counter_clock(),
        )

    opt, cfs = make(), []
    for step in range(20):
        if step == resume_at:
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            opt.close()
            opt = make()
            buf.seek(0)
            opt.load_state_dict(torch.load(buf, weights_only=True))
        train_step(m, opt, rank, step)
        assert opt.last_record is not None
        cfs.append(opt.last_record.cf_sent)
    strides = (opt.engine.windows.stride, opt.engine.shadows.stride)
    assert opt.engine.hierarchy is not None
    return {
        "cfs": cfs,
        "params": [p.detach().clone() for p in m.parameters()],
        "strides": strides,
        "shared": opt.engine.hierarchy.shared is not None,
    }


@pytest.mark.parametrize("budgets", [None, SMALL_BUDGETS])
def test_two_level_ranks_decide_alike_and_resume_bit_exactly(
    budgets: tuple[int, int] | None, gloo_pools: Workers
) -> None:
    """Also as a model of more than 64M elements would (``SMALL_BUDGETS``): each rank binds
    its chunks (4,274 elements a rank here), samples them at strides 64 and 256, and every
    rank decides alike, straight through and resumed."""
    straight = gloo_pools.run(searched, WORLD, None, budgets, timeout=SPAWN_TIMEOUT)
    resumed = gloo_pools.run(searched, WORLD, 9, budgets, timeout=SPAWN_TIMEOUT)
    strides = (16, 64) if budgets is None else (64, 256)
    assert all(r["strides"] == strides for r in (*straight, *resumed))
    for r in range(WORLD):
        assert straight[r]["cfs"] == straight[0]["cfs"]
        assert resumed[r]["cfs"] == straight[0]["cfs"]
        trios = zip(straight[0]["params"], straight[r]["params"], resumed[r]["params"], strict=True)
        for a, b, c in trios:
            assert torch.equal(a, b) and torch.equal(a, c)
    assert len(set(straight[0]["cfs"])) > 1  # the search moved


def test_the_node_stage_through_shared_memory_trains_as_its_collectives(
    gloo_pools: Workers,
) -> None:
    """The default (``node_stage="auto"``) maps the node's memory on this host; 20 steps of
    the search with backward overlapping the stages give the same CFs and parameters, bit
    for bit, as the node group's reduce-scatter and all-gather."""
    shared = gloo_pools.run(searched, WORLD, None, None, "auto", timeout=SPAWN_TIMEOUT)
    collective = gloo_pools.run(searched, WORLD, None, None, "collective", timeout=SPAWN_TIMEOUT)
    for r in range(WORLD):
        assert shared[r]["shared"] and not collective[r]["shared"]
        assert shared[r]["cfs"] == collective[r]["cfs"]
        pairs = zip(shared[r]["params"], collective[r]["params"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


def regrouped(rank: int, world_size: int, stage: str) -> dict[str, Any]:
    """Top-k in two levels on the tiny CNN, its last layer frozen for 3 steps, then added as a
    group (its residual-less tensors averaged densely at that step, the layout new after it),
    then the conv frozen: the parameters after 8 steps, the node's stages as ``stage`` moves
    them."""
    m = tiny_model(seed=0)
    last = m[5]
    last.requires_grad_(False)
    opt = GravacOptimizer(
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9),
        policy="fixed",
        policy_options={"cf": CF},
        ranks_per_node=NODE,
        node_stage=stage,
        clock=counter_clock(),
    )
    for step in range(8):
        if step == 3:
            last.requires_grad_(True)
            opt.add_param_group({"params": list(last.parameters())})
        if step == 6:
            m[0].requires_grad_(False)
        train_step(m, opt, rank, step)
    assert opt.engine.hierarchy is not None
    return {
        "params": [p.detach().clone() for p in m.parameters()],
        "shared": opt.engine.hierarchy.shared is not None,
    }


def test_layout_changes_in_two_levels_train_alike_both_ways(gloo_pools: Workers) -> None:
    shared = gloo_pools.run(regrouped, WORLD, "shm", timeout=SPAWN_TIMEOUT)
    collective = gloo_pools.run(regrouped, WORLD, "collective", timeout=SPAWN_TIMEOUT)
    for r in range(WORLD):
        assert shared[r]["shared"] and not collective[r]["shared"]
        pairs = zip(shared[r]["params"], collective[r]["params"], strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        same = zip(shared[0]["params"], shared[r]["params"], strict=True)
        assert all(torch.equal(a, b) for a, b in same)


def skipping(rank: int, world_size: int) -> dict[str, Any]:
    """Top-k in two levels over shared memory, rank 0's gradient not finite at steps 1-3
    (skipped on every rank): the bytes each rank maps after every step, and the steps taken."""
    m = model()
    opt = GravacOptimizer(
        torch.optim.SGD(m.parameters(), lr=1.0),
        policy="fixed",
        policy_options={"cf": CF},
        ranks_per_node=NODE,
        node_stage="shm",
        clock=counter_clock(),
    )
    mapped = []
    for step in range(STEPS):
        for p, g in zip(m.parameters(), normal_grads(rank, step), strict=True):
            p.grad = g
        if rank == 0 and step in (1, 2, 3):
            m.weight.grad[0, 0] = float("nan")
        opt.step()
        assert opt.engine.hierarchy is not None and opt.engine.hierarchy.shared is not None
        mapped.append(opt.engine.hierarchy.shared.mapped_bytes())
    return {"mapped": mapped, "steps": opt.engine.steps}


def test_skipped_steps_reuse_the_node_memory(gloo_pools: Workers) -> None:
    """A skipped step begins again at the same step count; its stages take the same regions,
    so the node's memory does not grow with the skips."""
    for out in gloo_pools.run(skipping, WORLD, timeout=SPAWN_TIMEOUT):
        assert out["steps"] == STEPS - 3
        assert out["mapped"][0] > 0
        assert out["mapped"] == [out["mapped"][0]] * STEPS


def refused(rank: int, world_size: int) -> dict[str, str]:
    m = model()
    errors = {}
    try:
        GravacOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), ranks_per_node=3)
    except ValueError as exc:
        errors["size"] = str(exc)
    flat = GravacOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), ranks_per_node=1)
    two = GravacOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), ranks_per_node=NODE)
    for p, g in zip(m.parameters(), grads(rank, 0), strict=True):
        p.grad = g
    two.step()
    try:
        flat.load_state_dict(two.state_dict())
    except ValueError as exc:
        errors["load"] = str(exc)
    return errors


def test_a_bad_node_size_or_a_checkpoint_of_other_nodes_is_refused(gloo_pools: Workers) -> None:
    errors = gloo_pools.run(refused, WORLD, timeout=SPAWN_TIMEOUT)[0]
    assert "ranks_per_node must divide the world size 4" in errors["size"]
    assert "saved with ranks_per_node=2" in errors["load"]
    assert "flat (4 ranks)" in errors["load"]


def hook_by_hand(
    rank: int, world_size: int, compressor: str, nodes: int, precision: str = "fp32"
) -> dict[str, Any]:
    """DDP with gravac's hook, ``ranks_per_node=nodes``, ``node_precision=precision``:
    ``STEPS`` steps of SGD (lr 1) on
    the weight gradients of :func:`grads` (:func:`hook_grads`); each step's aggregate, and the
    residual pieces the hook's state holds after the last (by parameter numel)."""
    m = model()
    net = DistributedDataParallel(m)
    policy: dict[str, Any] = (
        {"policy": "fixed", "policy_options": {"cf": CF}} if compressor == "topk" else {}
    )
    state = GravacHookState(
        compressor=compressor,
        ranks_per_node=nodes,
        node_precision=precision,
        clock=counter_clock(),
        **policy,
    )
    net.register_comm_hook(state, gravac_hook)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    aggregates = []
    for step in range(STEPS):
        opt.zero_grad()
        gw = grads(rank, step)[0]
        # the batch is the identity and the loss weighs the outputs by gw: d/dW is gw
        (net(torch.eye(7)) * gw.T).sum().backward()
        aggregates.append([p.grad.clone() for p in m.parameters()])  # type: ignore[union-attr]
        opt.step()
    pieces = {v.numel(): v.clone() for v in state.state_dict()["residuals"].values()}
    return {"aggregates": aggregates, "pieces": pieces, "topology": str(state.engine.topology)}


def hook_grads(rank: int, step: int) -> list[torch.Tensor]:
    """The gradients :func:`hook_by_hand`'s loss has: the weight's of :func:`grads`, and the
    bias's its row sums."""
    gw = grads(rank, step)[0]
    return [gw, gw.sum(1)]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_hook_in_two_levels_sends_everything_as_the_flat_mean(
    gloo_pools: Workers, precision: str
) -> None:
    # float16 inside the nodes holds the small integers' halves and quarters exactly
    two = gloo_pools.run(hook_by_hand, WORLD, "none", NODE, precision, timeout=SPAWN_TIMEOUT)
    flat = gloo_pools.run(hook_by_hand, WORLD, "none", 1, timeout=SPAWN_TIMEOUT)
    assert two[0]["topology"] == "2 node(s) of 2 ranks"
    _all_the_mean(two, flat, hook_grads)


def test_the_hook_in_two_levels_keeps_error_feedback_across_its_bucket_rebuild(
    gloo_pools: Workers,
) -> None:
    """DDP rebuilds its buckets after the first step: the chunks' residuals are carried into
    the new buckets as each rank's share of its node's sum, and nothing is lost."""
    out = gloo_pools.run(hook_by_hand, WORLD, "topk", NODE, timeout=SPAWN_TIMEOUT)
    for r in range(1, WORLD):
        for a, b in zip(out[0]["aggregates"], out[r]["aggregates"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # each rank's pieces are its chunk's residual times L at its place: their mean over every
    # rank is the nodes' mean residual, which error feedback has still to send
    held = sum(out[r]["pieces"][35] for r in range(WORLD)) / WORLD
    applied = sum(a[0].reshape(-1) for a in out[0]["aggregates"])
    wanted = sum(torch.stack(_node_means(t)).mean(0) for t in range(STEPS))
    assert float(held.abs().sum()) > 0  # something is held back
    torch.testing.assert_close(applied + held, wanted, rtol=0, atol=1e-5)


def hook_resume(
    rank: int, world_size: int, budgets: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The default search through the hook in two levels: 10 steps straight against 4 + the
    state pickled (as a checkpoint) + 6 in a fresh DDP, the search's samples under
    ``budgets`` (:func:`tests.helpers.sample_budgets`; ``None``: the real ones)."""
    with sample_budgets(budgets):
        return _hook_resume(rank)


def _hook_resume(rank: int) -> dict[str, Any]:

    def hooked(m: nn.Module, state: GravacHookState | None = None) -> tuple[Any, Any]:
        net = DistributedDataParallel(m)
        state = state or GravacHookState(
            ranks_per_node=NODE, window=3, warmup_steps=2, clock=counter_clock()
        )
        net.register_comm_hook(state, gravac_hook)
        return net, state

    def fit(net: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    ref = tiny_model(seed=0)
    net, first = hooked(ref)
    fit(net, torch.optim.SGD(ref.parameters(), lr=0.1), range(10))
    # the window and shadow sums held by layer id, and the ids of the chunks now sent
    engine = first.engine
    held = {k for sums in (engine.windows.sent, *engine.windows.earlier) for k in sums}
    held |= {k for _, unit in (*engine.shadows.residual, *engine.shadows.sent) for k in unit}
    held |= {k for sums in engine.shadows.earlier for _, k in sums}
    chunks = {piece_key(key, 0) for key in first._units}
    m = tiny_model(seed=0)
    net, state = hooked(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    fit(net, opt, range(4))
    saved = through_torch_save({"model": m.state_dict(), "hook": state})
    m2 = tiny_model(seed=1)
    m2.load_state_dict(saved["model"])
    restored: GravacHookState = saved["hook"]
    restored.engine.clock = counter_clock()
    net, _ = hooked(m2, restored)
    fit(net, torch.optim.SGD(m2.parameters(), lr=0.1), range(4, 10))
    same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), m2.parameters(), strict=True))
    strides = (restored.engine.windows.stride, restored.engine.shadows.stride)
    return {
        "same": same,
        "topology": str(restored.engine.topology),
        "stale": held - chunks,
        "strides": strides,
    }


@pytest.mark.parametrize("budgets", [None, SMALL_BUDGETS])
def test_the_hook_in_two_levels_resumes_bit_exactly(
    budgets: tuple[int, int] | None, gloo_pools: Workers
) -> None:
    """DDP starts the resumed run in its first buckets and rebuilds them after a step, as the
    uninterrupted run did at its start: the chunks hold the same elements in both. No window
    or shadow sums of the chunks of the first buckets outlive their rebuild. Also with the
    search's samples thinned, as a model of more than 64M elements has them."""
    strides = (16, 64) if budgets is None else (64, 256)
    for r in gloo_pools.run(hook_resume, WORLD, budgets, timeout=SPAWN_TIMEOUT):
        assert r["strides"] == strides
        assert r["same"] and r["topology"] == "2 node(s) of 2 ranks"
        assert r["stale"] == set()
