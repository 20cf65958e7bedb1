"""The engine times each step from the end of the step before to its own end and counts it at
the CF the step sent (gravac.engine.core.Engine.commit): a time holds one step's costs only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gravac import GravacOptimizer
from gravac.control.searches.shadow import TOP_WARMUP_STEPS, ShadowController
from tests.helpers import batch, tiny_model, train_step

#: seconds a step takes at the top of the ladder and at theta_min, by the test's clock
TOP, MIN = 3.0, 5.0


def test_each_step_is_timed_whole_at_the_cf_it_sent() -> None:
    """The warm-up alternates the top of the ladder with theta_min: the times counted at the
    top are its steps' alone, theta_min's are its own, and the first step is not timed."""
    now = [0.0]
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GravacOptimizer(sgd, warmup_steps=10, search="shadow", clock=lambda: now[0])
    search = opt.engine.controller
    assert isinstance(search, ShadowController) and search.ladder[-1] > search.ladder[0]
    for step in range(10):
        now[0] += TOP if step in TOP_WARMUP_STEPS else MIN  # the step's own time passes
        train_step(model, opt, 0, step)
    state = search.state_dict()
    # the top's steps after the first (theirs agreed a step later: 2, 4 and 6)
    assert state["top_samples"] == [TOP] * (len(TOP_WARMUP_STEPS) - 1)
    # theta_min's steps 1, 3, 5, 7 and 8 (the ninth's is agreed at the tenth)
    assert state["samples"] == [pytest.approx(1.0 / MIN)] * 5
    now[0] += MIN
    train_step(model, opt, 0, 10)  # closes the warm-up
    assert search.top_seconds == TOP
    assert search.windows.smoothed.tsys[search.ladder[0]] == pytest.approx(1.0 / MIN)


def test_a_dropped_step_is_not_timed_and_the_next_is_timed_from_its_end() -> None:
    """A backward pass whose gradients ``zero_grad()`` discards (the step dropped on every
    rank) takes 100 s: no time counted holds them, and none is lost or counted twice."""
    now = [0.0]
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GravacOptimizer(sgd, warmup_steps=20, search="trial", clock=lambda: now[0])
    for step in range(4):
        now[0] += MIN
        train_step(model, opt, 0, step)
    now[0] += 100.0  # the dropped step's own time
    x, y = batch(0, 4)
    nn.functional.cross_entropy(model(x), y).backward()  # the hooks launch its buckets
    opt.zero_grad()  # and the step is dropped
    for step in range(4, 8):
        now[0] += MIN
        train_step(model, opt, 0, step)
    # steps 1 to 6 timed (the first is never; the seventh's is agreed at the eighth)
    assert opt.engine.controller.state_dict()["samples"] == [pytest.approx(1.0 / MIN)] * 6
