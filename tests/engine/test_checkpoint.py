"""A checkpoint that cannot resume training is refused when loaded, naming what is wrong, and
changes nothing (gravac.engine.checkpoint); a run of skipped steps ends in a named error."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gravac import GravacOptimizer
from gravac.ddp import GravacHookState
from gravac.engine.core import MAX_SKIP_RUN
from tests.helpers import counter_clock, tiny_model, train_step


def trained(**options: Any) -> tuple[nn.Module, GravacOptimizer]:
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GravacOptimizer(sgd, window=3, warmup_steps=2, clock=counter_clock(), **options)
    for step in range(4):
        train_step(model, opt, 0, step)
    return model, opt


def first_residual(state: dict[str, Any]) -> tuple[int, torch.Tensor]:
    return next(iter(state["gravac"]["memory"]["residuals"].items()))


def poison_nan(state: dict[str, Any]) -> None:
    key, e = first_residual(state)
    e = e.clone()
    e.view(-1)[3] = math.nan
    state["gravac"]["memory"]["residuals"][key] = e


def poison_shape(state: dict[str, Any]) -> None:
    key, e = first_residual(state)
    state["gravac"]["memory"]["residuals"][key] = e.view(-1)[:-1].clone()


def poison_dtype(state: dict[str, Any]) -> None:
    key, e = first_residual(state)
    state["gravac"]["memory"]["residuals"][key] = e.double()


def poison_key(state: dict[str, Any]) -> None:
    key, e = first_residual(state)
    state["gravac"]["memory"]["residuals"][key + 100] = e


def poison_phase(state: dict[str, Any]) -> None:
    del state["gravac"]["controller"]["phase"]


def poison_steps(state: dict[str, Any]) -> None:
    del state["gravac"]["steps"]


def poison_time(state: dict[str, Any]) -> None:
    state["gravac"]["last_seconds"] = math.inf


@pytest.mark.parametrize(
    ("poison", "says"),
    [
        (poison_nan, r"memory\['residuals'\]\[\d+\] holds 1 non-finite value"),
        (poison_shape, r"has \d+ elements of torch.float32; its bucket's gradient has \d+"),
        (
            poison_dtype,
            r"elements of torch.float64; its bucket's gradient has \d+ of torch.float32",
        ),
        (poison_key, r"belongs to no bucket of this optimizer"),
        (poison_phase, r"controller state is missing 'phase'"),
        (poison_steps, r"gravac state is missing \['steps'\]"),
        (poison_time, r"last_seconds is inf: a step's seconds \(finite, >= 0\) or -1"),
    ],
)
def test_a_checkpoint_that_cannot_resume_is_refused_and_changes_nothing(
    poison: Callable[[dict[str, Any]], None], says: str
) -> None:
    model, source = trained()
    state = copy.deepcopy(source.state_dict())
    poison(state)
    _, target = trained()
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=says):
        target.load_state_dict(state)
    after = target.state_dict()
    assert after["gravac"]["controller"] == before["gravac"]["controller"]
    for key, e in before["gravac"]["memory"]["residuals"].items():
        assert torch.equal(after["gravac"]["memory"]["residuals"][key], e)
    train_step(model, target, 0, 4)  # and it trains on
    assert target.skipped_steps == 0


def test_the_hook_state_refuses_a_non_finite_residual() -> None:
    state = GravacHookState(None, window=3)
    saved = state.state_dict()
    saved["residuals"] = {0: torch.tensor([1.0, math.inf])}
    saved["shapes"] = {0: [2]}
    with pytest.raises(ValueError, match=r"hook state\['residuals'\]\[0\] holds 1 non-finite"):
        GravacHookState(None, window=3).load_state_dict(saved)
    del saved["shapes"]
    with pytest.raises(ValueError, match=r"missing \['shapes'\]"):
        GravacHookState(None, window=3).load_state_dict(saved)


def nan_step(model: nn.Module, opt: GravacOptimizer) -> None:
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    opt.step()


def test_a_run_of_skipped_steps_raises_naming_the_likely_cause() -> None:
    model, opt = trained()
    with pytest.warns(RuntimeWarning, match="skipped"):
        for _ in range(MAX_SKIP_RUN - 1):
            nan_step(model, opt)
        train_step(model, opt, 0, 5)  # one finite step ends the run
        for _ in range(MAX_SKIP_RUN - 1):
            nan_step(model, opt)
        with pytest.raises(FloatingPointError, match=f"skipped {MAX_SKIP_RUN} steps in a row"):
            nan_step(model, opt)
    assert opt.skipped_steps == 2 * (MAX_SKIP_RUN - 1) + 1
    train_step(model, opt, 0, 6)  # the optimizer is usable after the error
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_readmes_checkpoints_load_with_torchs_default_weights_only(tmp_path: Path) -> None:
    """``torch.save`` of ``opt.state_dict()`` and of ``state.state_dict()`` (the README's
    examples) loads with ``torch.load``'s default ``weights_only=True`` and resumes."""
    _, opt = trained()
    hook = GravacHookState(None, window=3)
    path = tmp_path / "ckpt-rank0.pt"
    torch.save({"opt": opt.state_dict(), "hook": hook.state_dict()}, path)
    saved = torch.load(path)
    _, again = trained()
    again.load_state_dict(saved["opt"])
    assert again.state_dict()["gravac"]["steps"] == opt.state_dict()["gravac"]["steps"]
    fresh = GravacHookState(None, window=3)
    fresh.load_state_dict(saved["hook"])
    assert fresh.state_dict()["steps"] == hook.state_dict()["steps"]
