"""Mixed precision: GravacOptimizer under torch.amp.GradScaler and gravac.amp.GradScaler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gravac
from gravac import GravacOptimizer
from gravac.ddp import GravacHookState, gravac_hook
from tests.helpers import batch, counter_clock, tiny_model
from tests.workers import Workers

STEPS = 12
#: the step whose loss is NaN on the last rank: skipped on every rank, the scale backed off
NAN_STEP = 5
#: clean steps before a GradScaler doubles its scale: it grows twice and backs off once here
GROWTH_INTERVAL = 3
SPAWN_TIMEOUT = 240.0

#: GravacOptimizer options: each keeps other state in the gradients' unit
VARIANTS: dict[str, dict[str, Any]] = {
    "topk": {"compressor": "topk", "policy": "fixed", "policy_options": {"cf": 4}},
    "dgc": {"compressor": "dgc", "policy": "fixed", "policy_options": {"cf": 4}},
    "thc": {"compressor": "thc", "policy": "fixed", "policy_options": {"cf": 4}},
    "fp16": {"compressor": "fp16", "policy": "fixed", "policy_options": {"cf": 2}},
    "search": {"compressor": "topk", "window": 2, "warmup_steps": 2, "theta_min": 4.0},
    "accordion": {
        "compressor": "topk",
        "policy": "accordion",
        "policy_options": {"interval": 2},
        "warmup_steps": 2,
    },
}


def _optimizer(model: nn.Module, variant: str) -> GravacOptimizer:
    return GravacOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        dense_bytes=0,
        clock=counter_clock(),
        **VARIANTS[variant],
    )


def _scaler(kind: str, hooks: list[GravacHookState] | None = None) -> torch.amp.GradScaler | None:
    """No scaler (``"none"``), ``gravac.amp.GradScaler`` (``"gravac"``, rescaling ``hooks``)
    or torch's (``"torch"``), growing every :data:`GROWTH_INTERVAL` clean steps."""
    if kind == "gravac":
        return gravac.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL, hooks=hooks or [])
    if kind == "torch":
        return torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    return None


def _update(
    loss: torch.Tensor,
    opt: torch.optim.Optimizer,
    amp: torch.amp.GradScaler | None,
    *,
    synchronize: bool,
) -> None:
    """Backward and step, through ``amp`` where there is one (``opt.synchronize()`` between,
    with ``synchronize``)."""
    if amp is None:
        loss.backward()
        opt.step()
        return
    amp.scale(loss).backward()
    if synchronize:
        assert isinstance(opt, GravacOptimizer)
        opt.synchronize()
    amp.step(opt)
    amp.update()


def amp_run(rank: int, world_size: int, variant: str, scaler: str) -> dict[str, Any]:
    """Train :data:`STEPS` steps, the last rank's loss NaN at :data:`NAN_STEP`: unscaled
    (``scaler="none"``), through ``gravac.amp.GradScaler`` (``"gravac"``), or through torch's
    with ``opt.synchronize()`` first (``"torch"``)."""
    model = tiny_model(seed=0)
    opt = _optimizer(model, variant)
    amp = _scaler(scaler)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        if step == NAN_STEP and rank == world_size - 1:
            loss = loss * float("nan")
        _update(loss, opt, amp, synchronize=scaler == "torch")
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "skipped": opt.skipped_steps,
        "steps": opt.steps,
        "scale": None if amp is None else amp.get_scale(),
        "units": _in_gradient_units(opt),
    }


def _in_gradient_units(opt: GravacOptimizer) -> dict[str, list[torch.Tensor]]:
    """Everything the engine keeps in the gradients' unit, flattened, by where it is kept."""
    engine = opt.engine

    def tensors(tree: Any) -> list[torch.Tensor]:
        if isinstance(tree, torch.Tensor):
            return [tree.double().reshape(-1)]
        if isinstance(tree, dict):
            return [t for k in sorted(tree, key=str) for t in tensors(tree[k])]
        if isinstance(tree, list | tuple):
            return [t for item in tree for t in tensors(item)]
        return []

    controller = engine.controller.state_dict().get("accordion", {}).get("norms", {})
    norms = [controller[k] for k in sorted(controller)]
    return {
        "memory": tensors(engine.memory.state_dict()),
        "windows": tensors(engine.windows.state_dict()),
        "shadows": tensors(engine.shadows.state_dict()),
        "norms": tensors(engine.norms.state_dict()["acc"]),
        "accordion": [torch.tensor(norms, dtype=torch.float64)],
    }


def _same_up_to(scale: float, plain: dict[str, Any], scaled: dict[str, Any]) -> list[str]:
    """Where ``scaled``'s state in the gradients' unit is not ``scale`` times ``plain``'s."""
    wrong = []
    for name, ours in scaled["units"].items():
        theirs = plain["units"][name]
        if len(ours) != len(theirs) or not all(
            torch.equal(a, b * scale) for a, b in zip(ours, theirs, strict=True)
        ):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gravacs_grad_scaler_trains_bit_for_bit_as_unscaled_gradients(variant: str) -> None:
    """The scale grows twice and backs off once (at the NaN step): the residuals, momenta and
    search sums are rescaled with it (powers of two, exact), so the parameters are those of
    training without a scaler, bit for bit."""
    plain = amp_run(0, 1, variant, "none")
    scaled = amp_run(0, 1, variant, "gravac")
    assert plain["skipped"] == scaled["skipped"] == 1
    assert scaled["steps"] == STEPS - 1
    assert scaled["scale"] == 65536.0 * 2 * 2 / 2 * 2  # grown at steps 3 and 9, 12 missed
    assert torch.equal(plain["params"], scaled["params"])
    # what the engine keeps is in the last step's unit: the scale times the unscaled run's
    assert _same_up_to(scaled["scale"], plain, scaled) == []


def test_torchs_grad_scaler_after_synchronize_steps_unscaled_aggregates() -> None:
    """torch's own scaler after opt.synchronize() (the README's pattern before
    gravac.amp.GradScaler): the step unscales and skips as torch's scaler asks (found_inf,
    grad_scale). Without the rescale at each change of scale, the residuals of the steps
    before it count at the wrong scale: close to the unscaled run, not equal."""
    plain = amp_run(0, 1, "topk", "none")
    scaled = amp_run(0, 1, "topk", "torch")
    assert scaled["skipped"] == 1 and scaled["steps"] == STEPS - 1
    assert not torch.equal(plain["params"], scaled["params"])
    torch.testing.assert_close(scaled["params"], plain["params"], rtol=0.05, atol=0.05)


def torch_scaler_unsynchronized(rank: int, world_size: int) -> dict[str, Any]:
    """torch's GradScaler driving GravacOptimizer with no synchronize(): the named error,
    then, after zero_grad(), gravac's scaler trains on."""
    model = tiny_model(seed=0)
    opt = _optimizer(model, "topk")
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(rank, 0)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
    try:
        scaler.step(opt)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    opt.zero_grad()
    ours = gravac.amp.GradScaler("cpu")
    for step in range(1, 4):
        opt.zero_grad()
        x, y = batch(rank, step)
        ours.scale(nn.functional.cross_entropy(model(x), y)).backward()
        ours.step(opt)
        ours.update()
    return {
        "error": error,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "steps": opt.steps,
    }


@pytest.mark.slow
def test_torchs_grad_scaler_without_synchronize_raises_on_every_rank(
    gloo_pools: Workers,
) -> None:
    """Before, torch's scaler unscaled the gradients already sent (its kernel bumps no
    version, so the stale check missed it) and the wrapped optimizer stepped on scaled
    aggregates: the parameters grew to NaN within 4 steps."""
    out = gloo_pools.run(torch_scaler_unsynchronized, 2, timeout=SPAWN_TIMEOUT)
    for r in out:
        assert "gravac.amp.GradScaler" in r["error"] and "opt.synchronize()" in r["error"]
        assert r["steps"] == 3
    assert torch.equal(out[0]["params"], out[1]["params"])
    assert bool(out[0]["params"].isfinite().all())


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["topk", "search"])
def test_a_nan_on_one_rank_backs_every_ranks_scale_off_alike(
    gloo_pools: Workers, variant: str
) -> None:
    """Rank 1 alone has a NaN loss: every rank skips the step and halves its scale, and the
    two ranks train bit for bit as without a scaler."""
    plain = gloo_pools.run(amp_run, 2, variant, "none", timeout=SPAWN_TIMEOUT)
    scaled = gloo_pools.run(amp_run, 2, variant, "gravac", timeout=SPAWN_TIMEOUT)
    assert scaled[0]["scale"] == scaled[1]["scale"] == 65536.0 * 2 * 2 / 2 * 2
    for a, b in zip(plain, scaled, strict=True):
        assert a["skipped"] == b["skipped"] == 1
        assert torch.equal(a["params"], b["params"])
    assert torch.equal(scaled[0]["params"], scaled[1]["params"])


def hook_amp_run(rank: int, world_size: int, scaler: str) -> dict[str, Any]:
    """DDP with gravac's hook (Top-k at CF 4), :data:`STEPS` steps: unscaled (``"none"``),
    through ``gravac.amp.GradScaler(hooks=[state])`` (``"gravac"``) or torch's own
    (``"torch"``), the scale growing three times."""
    model = tiny_model(seed=0)
    net = DistributedDataParallel(model)
    state = GravacHookState(**VARIANTS["topk"])
    net.register_comm_hook(state, gravac_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp = _scaler(scaler, hooks=[state])
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        _update(nn.functional.cross_entropy(net(x), y), opt, amp, synchronize=False)
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "scale": None if amp is None else amp.get_scale(),
    }


@pytest.mark.slow
def test_gravacs_grad_scaler_rescales_the_ddp_hooks_residuals(gloo_pools: Workers) -> None:
    """Through the hook, the scaler's growth rescales the residuals it names: training is bit
    for bit the unscaled run's; torch's scaler leaves them in the old scale (close, not equal)."""
    plain, ours, torchs = (
        gloo_pools.run(hook_amp_run, 2, scaler, timeout=SPAWN_TIMEOUT)
        for scaler in ("none", "gravac", "torch")
    )
    assert ours[0]["scale"] == 65536.0 * 2**4  # grown after steps 2, 5, 8 and 11
    for a, b, c in zip(plain, ours, torchs, strict=True):
        assert torch.equal(a["params"], b["params"])
        assert not torch.equal(a["params"], c["params"])
        torch.testing.assert_close(c["params"], a["params"], rtol=0.05, atol=0.05)
    assert torch.equal(ours[0]["params"], ours[1]["params"])


def test_rescale_refuses_a_bad_factor_or_a_step_in_flight() -> None:
    model = tiny_model(seed=0)
    opt = _optimizer(model, "topk")
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor must be a finite number above 0"):
            opt.rescale(bad)
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()  # launches the step's buckets
    with pytest.raises(RuntimeError, match="between steps only"):
        opt.rescale(2.0)
    opt.step()
    opt.rescale(2.0)


def test_gravacs_grad_scaler_names_a_bad_hook() -> None:
    with pytest.raises(ValueError, match="hooks must be GravacHookState objects"):
        gravac.amp.GradScaler("cpu", hooks=[object()])  # type: ignore[list-item]
