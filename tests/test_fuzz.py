"""Fuzzing what real training does to the optimizer (issue 33 item 11), on 2 gloo ranks.

Hypothesis draws a model (tensors of random shapes, empty ones included, of float32, float64
or bfloat16, some frozen from the start), a compressor, a search and a schedule of faults (a
NaN or an Inf on one rank, a tensor frozen on every rank, a checkpoint round trip through
``torch.save`` into a new optimizer), and both ranks train it on a quadratic loss. Whatever is
drawn, one of two things must happen:

* both ranks raise the same named error (a refused configuration), never one rank alone (the
  other would wait in a collective: the pool's timeout fails the test); or
* the ranks end bit-identical with finite parameters, every fault's step skipped and no other
  (no silent skip storm), and, for the tensors trained throughout under plain error feedback,
  the error-feedback identity over the whole run:
  ``p_T = p_0 - lr * mean_r(sum_t g_{r,t} - e_{r,T})``: what was applied is exactly what was
  computed, less what is still owed (``e``), as ``e_{t+1} = g_t + e_t - sent_t`` telescopes.

The examples are derandomised, so CI runs the same ones every time; ``GRAVAC_FUZZ_EXAMPLES``
sets how many (more for a longer search by hand).
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gravac import GravacOptimizer, compressors
from gravac.buckets import split_flat
from gravac.memory import ResidualMemory
from tests.helpers import counter_clock
from tests.workers import Workers

pytestmark = pytest.mark.slow

#: steps every drawn run trains
STEPS = 6
#: the learning rate of plain SGD (no momentum: the identity is about what was sent)
LR = 0.1
#: examples per run of the suite (each is one run on the pool's two ranks, about a second)
EXAMPLES = int(os.environ.get("GRAVAC_FUZZ_EXAMPLES", "12"))
#: seconds one drawn run may take on both ranks before the test fails (a rank left waiting)
RUN_TIMEOUT = 120.0
#: the identity's tolerance: float32 sums over a few steps, and 16-bit sums on the wire
IDENTITY_RTOL, IDENTITY_ATOL = 1e-2, 1e-3
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SEARCHES = ("trial", "shadow", "paper", "accordion", "fixed")
#: faults at a step: on one rank (the non-finite ones) or on every rank
FAULTS = ("nan", "inf", "freeze", "checkpoint")
#: errors a refused configuration may raise (named, the same on every rank)
NAMED_ERRORS = (ValueError, TypeError, FloatingPointError)


def _optimizer(params: list[nn.Parameter], scenario: dict[str, Any]) -> GravacOptimizer:
    options: dict[str, Any] = {"window": 2, "warmup_steps": 1, "clock": counter_clock()}
    search = scenario["search"]
    if search == "fixed":
        options.update(policy="fixed", policy_options={"cf": scenario["cf"]})
    elif search == "accordion":
        options["policy"] = search
    else:
        options["search"] = search
    sgd = torch.optim.SGD(params, lr=LR)
    return GravacOptimizer(sgd, compressor=scenario["compressor"], **options)


def _residuals(opt: GravacOptimizer, params: list[nn.Parameter]) -> dict[int, torch.Tensor]:
    """Each parameter's final residual (float64), by its index; none: nothing owed."""
    layout = opt._layout
    assert layout is not None
    index = {id(p): i for i, p in enumerate(params)}
    out = {}
    for run in layout.runs[: len(layout.compressed)]:
        e = opt._run_residual(layout, run)
        if e is not None:
            for p, part in split_flat(e, run.bucket.params):
                out[index[id(p)]] = part.double().clone()
    return out


def _train(rank: int, world_size: int, scenario: dict[str, Any]) -> dict[str, Any]:
    """One drawn run on this rank: what it ended with, or the error it raised."""
    torch.manual_seed(scenario["seed"])
    params = [
        nn.Parameter(torch.randn(shape).to(DTYPES[dtype]), requires_grad=not frozen)
        for shape, dtype, frozen in scenario["tensors"]
    ]
    start = [p.detach().double().clone() for p in params]
    gen = torch.Generator().manual_seed(1000 * rank + scenario["seed"])
    targets = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
    sums = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    faults = dict(scenario["faults"])
    injected = 0
    try:
        opt = _optimizer(params, scenario)
        for step in range(STEPS):
            fault, on = faults.get(step, (None, 0))
            if fault == "freeze":
                frozen = params[step % len(params)]
                frozen.requires_grad_(False)
                frozen.grad = None
            elif fault == "checkpoint":
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt.close()
                opt = _optimizer(params, scenario)
                opt.load_state_dict(torch.load(buf, weights_only=True))
            opt.zero_grad()
            grads = [(p.detach() - t) for p, t in zip(params, targets, strict=True)]
            trainable = [i for i, p in enumerate(params) if p.requires_grad and p.numel()]
            if fault in ("nan", "inf") and trainable:
                injected += 1
                if rank == on:
                    grads[trainable[0]].view(-1)[0] = math.nan if fault == "nan" else math.inf
            loss = sum(
                ((p * g).sum() for p, g in zip(params, grads, strict=True) if p.requires_grad),
                torch.zeros(()),
            )
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
            skipped = opt.skipped_steps
            opt.step()
            if opt.skipped_steps == skipped:
                for s, g, p in zip(sums, grads, params, strict=True):
                    if p.requires_grad:
                        s += g.double()
        residuals = _residuals(opt, params) if type(opt.memory) is ResidualMemory else None
    except NAMED_ERRORS as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "params": [p.detach().double().clone() for p in params],
        "start": start,
        "sums": sums,
        "residuals": residuals,
        "trained": [p.requires_grad for p in params],
        "skipped": opt.skipped_steps,
        "injected": injected,
        "steps": opt.steps,
    }


_shape = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)
_tensor = st.tuples(_shape, st.sampled_from(sorted(DTYPES)), st.booleans())
_fault = st.tuples(st.sampled_from(FAULTS), st.integers(0, 1))
_scenario = st.fixed_dictionaries(
    {
        "tensors": st.lists(_tensor, min_size=1, max_size=4),
        "compressor": st.sampled_from(compressors.names()),
        "search": st.sampled_from(SEARCHES),
        "faults": st.dictionaries(st.integers(0, STEPS - 1), _fault, min_size=1, max_size=3).map(
            lambda d: sorted(d.items())
        ),
        "seed": st.integers(0, 2**16),
        "cf": st.sampled_from([1.0, 2.0, 10.0, 100.0]),
    }
)


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scenario=_scenario)
def test_any_model_compressor_search_and_faults_train_alike_or_fail_alike(
    scenario: dict[str, Any], gloo_pools: Workers
) -> None:
    a, b = gloo_pools.run(_train, 2, scenario, timeout=RUN_TIMEOUT)
    print(
        "OUTCOME",
        scenario["compressor"],
        scenario["search"],
        a.get("error", "trained")[:150],
        a.get("skipped"),
        a.get("residuals") is not None,
    )
    if "error" in a or "error" in b:
        assert a.get("error") == b.get("error"), (a.get("error"), b.get("error"))
        return
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)
        assert bool(torch.isfinite(x).all())
    assert a["skipped"] == b["skipped"] == a["injected"]
    assert a["steps"] + a["skipped"] == STEPS
    if a["residuals"] is None:  # DGC's momentum, or no error feedback: another identity
        return
    for i, (shape, dtype, _) in enumerate(scenario["tensors"]):
        if dtype == "bfloat16" or not a["trained"][i]:
            continue  # 8 bits of mantissa; or frozen, its residual left unapplied
        owed = [r["residuals"].get(i, torch.zeros(shape, dtype=torch.float64)) for r in (a, b)]
        computed = (a["sums"][i] + b["sums"][i] - owed[0] - owed[1]) / 2
        expected = a["start"][i] - LR * computed
        torch.testing.assert_close(a["params"][i], expected, rtol=IDENTITY_RTOL, atol=IDENTITY_ATOL)
