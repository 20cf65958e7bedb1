"""Accordion (gravac.control.searches.accordion, gravac.control.policies.accordion, the interval
sums of gravac.control.norms): the regime rule on scripted norm sequences, learning-rate decays,
agreement across ranks, skipped steps and checkpoints; per-layer CFs through the engine (error
feedback, wire), both front ends on real gloo process groups."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gravac import GravacOptimizer, compressors, policies
from gravac.config import learning_rate
from gravac.control.factory import make_controller
from gravac.control.norms import IntervalNorms
from gravac.control.options import ControllerConfig
from gravac.control.records import Observation, Plan, Skipped
from gravac.control.searches.accordion import AccordionController, is_critical
from gravac.ddp import GravacHookState, gravac_hook
from tests.helpers import batch, counter_clock, through_torch_save, tiny_model, train_step
from tests.workers import Workers

LOW, HIGH = 4.0, 20.0  # above a sparsifier's break-even (CF 2): sent sparse
#: two layers (stable ids) of three elements each, in one unit
LAYERS = (7, 3)
NUMELS = (3, 3)
SPAWN_TIMEOUT = 240.0


class Rank:
    """One rank's Accordion and the interval sums its engine keeps."""

    def __init__(self, interval: int = 2, eta: float = 0.5) -> None:
        policy = policies.create("accordion", interval=interval, eta=eta, low_cf=LOW, high_cf=HIGH)
        made = make_controller(policy, ControllerConfig(), 2, lambda cf: cf)
        assert isinstance(made, AccordionController)
        self.c = made
        self.norms = IntervalNorms()

    def regimes(self) -> dict[int, bool]:
        return self.c.regimes()


def controller(interval: int = 2, eta: float = 0.5) -> Rank:
    return Rank(interval, eta)


def gradient(norms: tuple[float, ...]) -> torch.Tensor:
    """A flat gradient whose layers point one way with these norms (so that sums add norms)."""
    return torch.cat([torch.tensor([n, 0.0, 0.0]) for n in norms])


def local_values(r: Rank, plan: Plan, lr: float | None) -> list[float]:
    """What a rank sends with the step's scalars: its learning rate and, at an interval's last
    step, its layers' norms (as the engine sends them)."""
    assert plan.norms
    norms = r.norms.local_norms() if plan.norms_due else []
    return [math.nan if lr is None else lr, *norms]


def step(
    ranks: list[Rank],
    norms: list[tuple[float, ...]],
    lrs: list[float | None] | None = None,
) -> list[tuple[float, ...]]:
    """One step on every rank's controller, the values agreed as the engine agrees them; the
    CFs each rank planned for the two layers."""
    plans: list[Plan] = []
    rows = []
    for i, r in enumerate(ranks):
        plans.append(r.c.plan())
        r.norms.add(LAYERS, gradient(norms[i]), NUMELS)
        rows.append(local_values(r, plans[-1], None if lrs is None else lrs[i]))
    table = torch.tensor(rows, dtype=torch.float64)
    for r, plan in zip(ranks, plans, strict=True):
        means = table[:, 1:].mean(dim=0).tolist()
        layer_norms = dict(zip(r.norms.layers, means, strict=True)) if plan.norms_due else None
        r.c.observe(Observation(plan, lrs=tuple(table[:, 0].tolist()), layer_norms=layer_norms))
        if plan.norms_due:
            r.norms.end_interval()
    return [p.cfs_for(LAYERS) for p in plans]


def run(c: Rank, norms: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    return [step([c], [n])[0] for n in norms]


def test_the_rule_sends_changing_layers_at_the_low_cf() -> None:
    """Intervals of 2 steps: the first two send low (nothing to compare with); layer 3's
    accumulated norm then triples (change 2 >= 0.5: critical), layer 7's stays (change 0)."""
    c = controller()
    cfs = run(c, [(1.0, 1.0)] * 4 + [(1.0, 3.0)] * 2 + [(1.0, 1.0)] * 2)
    assert cfs[:4] == [(LOW, LOW)] * 4
    assert cfs[4:6] == [(HIGH, HIGH)] * 2  # interval 2 against 1: no change
    assert cfs[6:8] == [(HIGH, LOW)] * 2  # interval 3 against 2: layer 3 changed
    assert c.regimes() == {7: False, 3: True}


def test_the_rule_is_the_relative_change_against_eta() -> None:
    assert is_critical(2.0, 3.0, 0.5)  # exactly eta
    assert not is_critical(2.0, 2.9, 0.5)
    assert is_critical(2.0, 0.9, 0.5)  # a drop counts as a change
    assert is_critical(0.0, 1.0, 0.5)  # nothing before: critical


def test_a_learning_rate_decay_sends_every_layer_low_until_the_interval_ends() -> None:
    c = controller(interval=4)
    for _ in range(8):
        step([c], [(1.0, 1.0)], [0.1])
    assert step([c], [(1.0, 1.0)], [0.1]) == [(HIGH, HIGH)]  # step 8, settled high
    assert step([c], [(1.0, 1.0)], [0.01]) == [(HIGH, HIGH)]  # step 9 sees the decay ...
    assert step([c], [(1.0, 1.0)], [0.01]) == [(LOW, LOW)]  # ... which holds from step 10
    assert step([c], [(1.0, 1.0)], [0.01]) == [(LOW, LOW)]
    assert step([c], [(1.0, 1.0)], [0.01]) == [(HIGH, HIGH)]  # the next interval decides again


def test_a_small_learning_rate_change_is_no_decay() -> None:
    """A cosine schedule moves the rate by far less than 10% a step."""
    c = controller(interval=4)
    lr = 0.1
    for _ in range(12):
        step([c], [(1.0, 1.0)], [lr])
        lr *= 0.95
    assert step([c], [(1.0, 1.0)], [lr]) == [(HIGH, HIGH)]


def test_a_decay_seen_by_one_rank_switches_every_rank() -> None:
    ranks = [controller(interval=4), controller(interval=4)]
    for _ in range(9):
        step(ranks, [(1.0, 1.0)] * 2, [0.1, 0.1])
    step(ranks, [(1.0, 1.0)] * 2, [0.01, 0.1])  # only rank 0 saw it
    assert step(ranks, [(1.0, 1.0)] * 2, [0.01, 0.1]) == [(LOW, LOW)] * 2


def test_ranks_decide_on_the_mean_norm_and_agree() -> None:
    """Rank 0's layer 3 alone is steady (it would go high), rank 1's triples: the mean doubles
    (change 1 >= 0.5), so both ranks send it low."""
    ranks = [controller(), controller()]
    for _ in range(4):
        step(ranks, [(1.0, 1.0)] * 2)
    for _ in range(2):
        step(ranks, [(1.0, 1.0), (1.0, 3.0)])
    assert step(ranks, [(1.0, 1.0)] * 2) == [(HIGH, LOW)] * 2
    assert ranks[0].regimes() == ranks[1].regimes()


def test_a_skipped_step_restarts_the_interval() -> None:
    c = controller()
    run(c, [(1.0, 1.0)] * 4)
    plan = c.c.plan()
    c.norms.add(LAYERS, torch.full((6,), math.nan), NUMELS)  # a non-finite step ...
    assert c.c.observe(Skipped(plan)).phase == "accordion"  # ... skipped on every rank
    c.norms.restart()
    assert c.c.window_step == 0
    run(c, [(1.0, 1.0)])
    plan = c.c.plan()
    c.norms.add(LAYERS, gradient((1.0, 1.0)), NUMELS)
    assert plan.norms_due  # the interval's two steps, the NaN forgotten
    assert local_values(c, plan, 0.1) == [0.1, 2.0, 2.0]


def test_state_dict_resumes_the_same_decisions() -> None:
    norms = [(1.0, 1.0)] * 4 + [(1.0, 3.0)] * 3 + [(2.0, 1.0)] * 5
    ref = controller()
    expected = run(ref, norms)
    c = controller()
    run(c, norms[:5])
    resumed = controller()
    saved = {"c": c.c.state_dict(), "norms": c.norms.state_dict()}
    saved = pickle.loads(pickle.dumps(copy.deepcopy(saved)))
    resumed.c.load_state_dict(saved["c"])
    resumed.norms.load_state_dict(saved["norms"])
    assert expected[:5] + run(resumed, norms[5:]) == expected


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"low_cf": 0.5}, "low_cf"),
        ({"low_cf": 10.0, "high_cf": 5.0}, "high_cf must be >= low_cf"),
        ({"interval": 0}, "interval must be an integer >= 1"),
        ({"interval": 2.5}, "interval must be an integer >= 1"),
        ({"eta": 0.0}, "eta must be a finite number > 0"),
        ({"eta": math.nan}, "eta must be a finite number > 0"),
        ({"eta": True}, "eta must be a finite number > 0"),
        ({"rank": 4}, "rank"),
        ({"low_rank": 0}, "low_rank must be an integer >= 1, got 0"),
        ({"high_rank": True}, "high_rank must be an integer >= 1, got True"),
        ({"low_rank": 2.0}, "low_rank must be an integer >= 1, got 2.0"),
        ({"low_rank": 2, "high_rank": 3}, "high_rank must be <= low_rank \\(2\\)"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        policies.create("accordion", **options)


def test_learning_rate_reads_the_largest_group() -> None:
    model = tiny_model()
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.5}, {"params": model[3].parameters()}], lr=0.1
    )
    assert learning_rate(opt) == 0.5
    assert learning_rate(None) is None


# ---------------------------------------------------------------------- through the engine
def accordion(model: nn.Module, **options: Any) -> GravacOptimizer:
    return GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        compressor="topk",
        policy="accordion",
        policy_options={"low_cf": LOW, "high_cf": 50.0, **options},
        dense_bytes=0,
        overlap=False,
    )


def mixed(opt: GravacOptimizer) -> list[int]:
    """Make every other layer summed so far critical (through the controller's checkpoint);
    the layers in launch order."""
    state = opt.engine.controller.state_dict()
    tracked = list(opt.engine.norms.layers)
    state["accordion"]["critical"] = {k: i % 2 == 0 for i, k in enumerate(tracked)}
    opt.engine.controller.load_state_dict(state)
    return tracked


def test_layers_at_their_own_cfs_keep_the_error_feedback_identity() -> None:
    """g + e_old == D(sent) + e_new exactly, with each layer's piece at its own CF: the
    critical layers keep a quarter of their values, the others a fiftieth."""
    model = tiny_model()
    opt = accordion(model, interval=1000)
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    mixed(opt)
    opt.zero_grad()
    x, y = batch(0, 1)
    nn.functional.cross_entropy(model(x), y).backward()
    matrices = [p for p in reversed(list(model.parameters())) if p.dim() > 1]  # bucket order
    g = torch.cat([p.grad.reshape(-1) for p in matrices])
    e_old = opt.memory.residual(0)
    assert e_old is not None
    e_old = e_old.clone()
    opt.synchronize()
    sent = torch.cat([p.grad.reshape(-1) for p in matrices])  # one rank: D(C(g + e_old))
    e_new = opt.memory.residual(0)
    assert e_new is not None
    assert torch.equal(g + e_old, sent + e_new)
    kept = [float((p.grad != 0).float().mean()) for p in matrices]
    assert kept[0] == pytest.approx(1 / LOW, abs=0.01)
    assert kept[2] == pytest.approx(1 / LOW, abs=0.01)
    assert kept[1] <= 1 / 50 + 0.01
    opt.step()
    record = opt.last_record
    assert record is not None and LOW < record.cf_achieved < 50.0
    assert record.cf_sent == record.cf_achieved and record.phase == "accordion"


@pytest.mark.parametrize("compressor", compressors.names())
def test_every_compressor_trains_with_layers_in_both_regimes(compressor: str) -> None:
    """Each layer's piece at its own CF, through every compressor (seeds, state and memory
    per piece): finite, and the same two batches are learnt."""
    model = tiny_model()
    opt = GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        compressor=compressor,
        policy="accordion",
        policy_options={"low_cf": LOW, "high_cf": 50.0, "interval": 1000},
        dense_bytes=0,
    )
    losses = [train_step(model, opt, 0, 0)]
    mixed(opt)
    losses += [train_step(model, opt, 0, s % 2) for s in range(1, 9)]
    assert all(math.isfinite(v) for v in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[2]
    record = opt.last_record
    assert record is not None and record.cf_sent == record.cf_achieved


def test_a_nonfinite_step_is_skipped_and_the_interval_restarts() -> None:
    model = tiny_model()
    opt = accordion(model, interval=3)
    for s in range(2):
        x, y = batch(0, s)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    e = opt.memory.residual(0)
    assert e is not None
    e = e.clone()
    opt.zero_grad()
    x, y = batch(0, 2)
    nn.functional.cross_entropy(model(x), y).backward()
    next(model.parameters()).grad[0] = math.nan  # type: ignore[index]
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert opt.skipped_steps == 1
    assert torch.equal(opt.memory.residual(0), e)  # type: ignore[arg-type]
    assert isinstance(opt.engine.controller, AccordionController)
    assert opt.engine.controller.window_step == 0


# ---------------------------------------------------------------------- on process groups
STEPS = 12
DECAY_AT = 7
#: on this model and data, a threshold at which the layers' regimes differ at some steps
ETA = 0.1


def fit(net: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """Train ``steps``; the learning rate decays 10x at step :data:`DECAY_AT`."""
    for s in steps:
        for group in opt.param_groups:
            group["lr"] = 0.1 if s < DECAY_AT else 0.01
        opt.zero_grad()
        x, y = batch(rank, s)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def options(**policy: Any) -> dict[str, Any]:
    return {
        "compressor": "topk",
        "policy": "accordion",
        "policy_options": {"low_cf": LOW, "high_cf": 50.0, "interval": 2, "eta": 0.2, **policy},
        "clock": counter_clock(),
    }


def front_ends(rank: int, world_size: int, eta: float) -> dict[str, Any]:
    """The optimizer and the DDP hook train the same model with Accordion, a decay included."""
    out: dict[str, Any] = {}
    a = tiny_model(seed=0)
    opt_a = GravacOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), **options(eta=eta))
    b = tiny_model(seed=0)
    net = DistributedDataParallel(b)
    state = GravacHookState(**options(eta=eta))
    net.register_comm_hook(state, gravac_hook)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    state.watch(opt_b)
    for name, model, module, opt, engine in (
        ("optimizer", a, a, opt_a, opt_a.engine),
        ("hook", b, net, opt_b, state.engine),
    ):
        cfs, regimes = [], []
        for s in range(STEPS):
            fit(module, opt, rank, range(s, s + 1))
            assert engine.last_record is not None
            cfs.append(engine.last_record.cf_sent)
            regimes.append([v for _, v in sorted(engine.controller.regimes().items())])
        out[name] = {
            "cfs": cfs,
            "regimes": regimes,
            "params": [p.detach().clone() for p in model.parameters()],
            "wire": engine.total_wire_bytes,
        }
    return out


@pytest.mark.slow
def test_both_front_ends_agree_across_ranks_and_with_each_other(gloo_pools: Workers) -> None:
    results = gloo_pools.run(front_ends, 2, ETA, timeout=SPAWN_TIMEOUT)
    for r in results:
        assert r["optimizer"]["cfs"] == r["hook"]["cfs"]
        assert r["optimizer"]["wire"] == r["hook"]["wire"]
        for pa, pb in zip(r["optimizer"]["params"], r["hook"]["params"], strict=True):
            assert torch.equal(pa, pb)
    ref = results[0]["optimizer"]
    for front_end in ("optimizer", "hook"):
        assert results[1][front_end]["regimes"] == results[0][front_end]["regimes"]
    for pa, pb in zip(ref["params"], results[1]["optimizer"]["params"], strict=True):
        assert torch.equal(pa, pb)
    regimes = ref["regimes"]
    assert any(len(set(r)) > 1 for r in regimes)  # layers in different regimes at one step
    assert regimes[DECAY_AT + 1] == [True] * len(regimes[DECAY_AT + 1])  # after the decay


def wrap(
    front_end: str, model: nn.Module, state: GravacHookState | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, GravacHookState | None]:
    """The module to train through, its optimizer and the hook state (``state``: a loaded one)."""
    if front_end == "optimizer":
        return (
            model,
            GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options()),
            None,
        )
    net = DistributedDataParallel(model)
    state = state if state is not None else GravacHookState(**options())
    net.register_comm_hook(state, gravac_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state.watch(opt)
    return net, opt, state


def resume(rank: int, world_size: int, front_end: str) -> bool:
    """12 steps straight against 5 + a checkpoint + 7 in fresh objects."""
    ref = tiny_model(seed=0)
    module, opt, _ = wrap(front_end, ref)
    fit(module, opt, rank, range(STEPS))
    model = tiny_model(seed=0)
    module, opt, state = wrap(front_end, model)
    fit(module, opt, rank, range(5))
    saved = through_torch_save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state}
    )
    model = tiny_model(seed=1)
    model.load_state_dict(saved["model"])
    module, opt, _ = wrap(front_end, model, saved["hook"])
    opt.load_state_dict(saved["opt"])
    fit(module, opt, rank, range(5, STEPS))
    return all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["optimizer", "hook"])
def test_a_checkpoint_resumes_bit_exactly(front_end: str, gloo_pools: Workers) -> None:
    assert all(gloo_pools.run(resume, 2, front_end, timeout=SPAWN_TIMEOUT))
