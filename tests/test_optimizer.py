"""GravacOptimizer as one worker: torch.optim behaviour, checkpoints, edge cases, monitoring."""

from __future__ import annotations

import gc
import io
import math
import os
import warnings
import weakref

import pytest
import torch
from torch import nn

from gravac import GravacOptimizer, TensorBoardMonitor, compressors, policies
from gravac.buckets import DEFAULT_BUCKET_BYTES, join_flat, split_flat
from gravac.compressors.dense import CAST_BUCKET_BYTES
from gravac.control.factory import make_controller
from gravac.control.options import ControllerConfig
from gravac.control.tables import cf_key
from gravac.memory import NoMemory, ResidualMemory
from tests.helpers import (
    SMALL_BUDGETS,
    Records,
    batch,
    counter_clock,
    sample_budgets,
    tiny_model,
    train_step,
)


def send_dense(opt: GravacOptimizer) -> None:
    """Make ``opt`` send every later step dense (CF 1)."""
    fixed = policies.create("fixed", cf=1.0)
    opt.engine.controller = make_controller(fixed, ControllerConfig(), opt.comm.world_size)


def make(model: nn.Module, **kw: object) -> GravacOptimizer:
    opts: dict[str, object] = {
        "compressor": "topk",
        "policy": "exponential",
        "dense_bytes": 0,
        "window": 3,
        "warmup_steps": 2,
        "ewma_alpha": 0.5,
        "clock": counter_clock(),
    }
    opts.update(kw)
    return GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **opts)  # type: ignore[arg-type]


def test_param_groups_are_shared_and_lr_scheduler_steps_the_wrapped_lr() -> None:
    model = tiny_model()
    opt = make(model)
    assert opt.param_groups is opt.optimizer.param_groups
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    for step in range(4):
        train_step(model, opt, 0, step)
        sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.01)


def test_add_param_group_reaches_the_wrapped_optimizer() -> None:
    model = tiny_model()
    extra = nn.Linear(3, 3)
    opt = make(model)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.5})
    assert len(opt.optimizer.param_groups) == 2
    assert opt.param_groups[1]["lr"] == 0.5


def test_zero_grad_sets_none() -> None:
    model = tiny_model()
    opt = make(model)
    train_step(model, opt, 0, 0)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def _run(opt_state: dict | None, steps: range) -> tuple[nn.Module, GravacOptimizer]:
    model = tiny_model()
    opt = make(model)
    if opt_state is not None:
        model.load_state_dict(opt_state["model"])
        opt.load_state_dict(opt_state["opt"])
    for step in steps:
        train_step(model, opt, 0, step)
    return model, opt


#: a static CF after a warm-up schedule that a checkpoint at step 5 cuts in two
_WARMED_STATIC = {"policy": "fixed", "policy_options": {"cf": 100, "warmup": [[2, 1000], [4, 10]]}}


@pytest.mark.parametrize(
    ("compressor", "bucket_bytes", "options"),
    [
        *((c, DEFAULT_BUCKET_BYTES, {}) for c in ("topk", "randomk", "fp16", "powersgd")),
        ("topk", 4096, {}),  # the Linear(256, 32) weight split across 8 buckets
        ("topk", DEFAULT_BUCKET_BYTES, _WARMED_STATIC),
    ],
)
def test_checkpoint_resume_is_bit_exact(
    compressor: str, bucket_bytes: int, options: dict[str, object]
) -> None:
    if compressor not in __import__("gravac").compressors.names():
        pytest.skip(f"{compressor} not registered")
    torch.manual_seed(0)
    ref_model = tiny_model()
    ref_opt = make(ref_model, compressor=compressor, bucket_bytes=bucket_bytes, **options)
    for step in range(12):
        train_step(ref_model, ref_opt, 0, step)

    model = tiny_model()
    opt = make(model, compressor=compressor, bucket_bytes=bucket_bytes, **options)
    for step in range(5):
        train_step(model, opt, 0, step)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed_model = tiny_model(seed=123)  # different init: everything must come from the file
    resumed_opt = make(resumed_model, compressor=compressor, bucket_bytes=bucket_bytes, **options)
    resumed_model.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    for step in range(5, 12):
        train_step(resumed_model, resumed_opt, 0, step)

    for a, b in zip(ref_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ref_opt.controller.state_dict() == resumed_opt.controller.state_dict()


def test_a_static_warmup_is_what_the_steps_send() -> None:
    model = tiny_model()
    opt = make(model, **_WARMED_STATIC)
    sent = []
    for step in range(8):
        train_step(model, opt, 0, step)
        assert opt.last_record is not None
        sent.append(opt.last_record.cf_sent)
    assert sent == [1000.0] * 2 + [10.0] * 4 + [100.0] * 2


@pytest.mark.parametrize("split", [0, 5])
def test_a_thinned_sample_resumes_bit_exactly(split: int) -> None:
    """Under budgets that a model of more than 64M elements meets (:data:`SMALL_BUDGETS`), the
    search samples from its second step at the larger strides, a checkpoint saved before the
    first step or after the fifth holds the stride its sums have, and the resumed run decides
    and trains bit for bit as the run straight through."""
    with sample_budgets(SMALL_BUDGETS):
        ref_model = tiny_model()
        ref_opt = make(ref_model)
        strides = []
        for step in range(12):
            train_step(ref_model, ref_opt, 0, step)
            strides.append((ref_opt.engine.windows.stride, ref_opt.engine.shadows.stride))
        assert strides == [(128, 512)] * 12  # fitted as the first step ends
        assert ref_opt.controller.state_dict()["shadow_gain"]  # the shadows were judged
        # what the search holds: each sum a block of 16 in 16 x stride, and a tail block, a
        # tensor (3 compressed: 36, 8192 and 320 elements)
        windows, shadows = ref_opt.engine.windows, ref_opt.engine.shadows
        for sums in (windows.sent, *windows.earlier):
            assert sum(t.numel() for t in sums.values()) <= 8548 // 128 + 3 * 16
        cfs = len(ref_opt.controller.state_dict()["shadow_gain"])
        assert shadows.nbytes() <= 3 * cfs * 4 * (8548 // 512 + 3 * 16)  # r, S, S before
        model = tiny_model()
        opt = make(model)
        for step in range(split):
            train_step(model, opt, 0, step)
        saved = {"model": model.state_dict(), "opt": opt.state_dict()}
        opt.close()
        resumed_model = tiny_model(seed=123)
        resumed_opt = make(resumed_model)
        resumed_model.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["opt"])
        for step in range(split, 12):
            train_step(resumed_model, resumed_opt, 0, step)
    for a, b in zip(ref_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ref_opt.controller.state_dict() == resumed_opt.controller.state_dict()


def test_a_group_that_takes_the_layout_past_the_sample_budget_thins_the_sample() -> None:
    """A group added mid-training makes the compressed layout larger than the budget allows
    at the base strides: from the step after its adoption the window and the shadows sample
    more thinly, their old sums dropped, and training goes on."""
    with sample_budgets((1024, 256)):  # tiny_model's 8,548 elements sample at the base strides
        model = tiny_model()
        opt = make(model)
        for step in range(4):
            train_step(model, opt, 0, step)
        assert (opt.engine.windows.stride, opt.engine.shadows.stride) == (16, 64)
        extra = nn.Linear(64, 160, bias=False)  # 10,240 more: 18,788 > 1024 x 16
        opt.add_param_group({"params": extra.parameters()})
        for step in range(4, 10):
            opt.zero_grad()
            x, y = batch(0, step)
            out = model(x) + extra(x.reshape(len(x), -1)).reshape(len(x), 10, 16).mean(-1)
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
        assert (opt.engine.windows.stride, opt.engine.shadows.stride) == (32, 128)
        held = sum(t.numel() for t in opt.engine.windows.sent.values())
        assert 0 < held <= 18_788 // 32 + 16 * 4  # a block of 16 a tensor's tail at most
    assert all(bool(torch.isfinite(p).all()) for p in (*model.parameters(), extra.weight))


def test_a_load_while_a_step_is_in_flight_is_refused_and_the_step_goes_on() -> None:
    """A backward pass launched its buckets with the residuals held then; loading now let the
    step's commit overwrite the loaded residuals without a word. Refused: nothing changes,
    and the step goes on to train exactly as if no load had been tried."""
    ref_model, model = tiny_model(), tiny_model()
    ref_opt, opt = make(ref_model), make(model)
    for step in range(3):
        train_step(ref_model, ref_opt, 0, step)
    train_step(model, opt, 0, 0)
    saved = opt.state_dict()
    train_step(model, opt, 0, 1)
    opt.zero_grad()
    x, y = batch(0, 2)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) while step 2 is in flight"):
        opt.load_state_dict(saved)
    opt.step()
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ref_opt.controller.state_dict() == opt.controller.state_dict()
    opt.load_state_dict(saved)  # between steps: loads
    assert opt.steps == 1


def test_state_dict_holds_residuals_and_controller() -> None:
    model = tiny_model()
    opt = make(model)
    for step in range(4):
        train_step(model, opt, 0, step)
    sd = opt.state_dict()
    assert sd["gravac"]["steps"] == 4
    assert sd["gravac"]["memory"]["residuals"]
    assert sd["gravac"]["controller"]["phase"] in {"search", "settled"}
    with pytest.raises(ValueError, match="not a GravacOptimizer state dict"):
        opt.load_state_dict(opt.optimizer.state_dict())


@pytest.mark.parametrize("overlap", [True, False])
def test_nonfinite_gradient_skips_the_step(overlap: bool) -> None:
    model = tiny_model()
    opt = make(model, overlap=overlap)
    train_step(model, opt, 0, 0)
    before = [p.detach().clone() for p in model.parameters()]
    residuals = {k: v.clone() for k, v in opt.memory.residuals.items()}  # type: ignore[attr-defined]
    opt.zero_grad()
    x, y = batch(0, 1)
    x[0, 0, 0, 0] = math.nan  # NaN gradients, launched during backward with overlap
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert opt.skipped_steps == 1 and opt.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(residuals[k], v) for k, v in opt.memory.residuals.items())  # type: ignore[attr-defined]


def test_nonfinite_raise_mode() -> None:
    model = tiny_model()
    opt = make(model, nonfinite="raise", overlap=False)
    opt.zero_grad()
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    next(model.parameters()).grad.fill_(math.inf)  # type: ignore[union-attr]
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()


def test_a_gradient_changed_after_its_bucket_was_sent_raises() -> None:
    """With overlap, buckets travel during backward: a later change (clipping before
    synchronize) would be lost silently, so it raises, and the step changes nothing."""
    model = tiny_model()
    opt = make(model)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"opt\.synchronize"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not opt.memory.residuals  # type: ignore[attr-defined]
    # Clipping after synchronize() works on the aggregate.
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    opt.step()
    assert opt.steps == 1


@pytest.mark.parametrize("policy", ["fixed", "exponential"])
def test_an_empty_matrix_parameter_steps(policy: str) -> None:
    """A 0 x 5 weight alone in a bucket: an empty compressed unit, defined as finite."""
    empty, weight = nn.Parameter(torch.randn(0, 5)), nn.Parameter(torch.randn(4, 4))
    sgd = torch.optim.SGD([empty, weight], lr=0.1)
    opt = GravacOptimizer(
        sgd, policy=policy, policy_options={"cf": 2} if policy == "fixed" else None, bucket_bytes=1
    )
    before = weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        (weight.square().sum() + empty.sum()).backward()
        opt.step()
    assert opt.steps == 2 and opt.skipped_steps == 0
    assert not torch.equal(weight, before)


def test_frozen_and_missing_gradients() -> None:
    """Frozen parameters, and parameters without a gradient, are left alone (grad None)."""
    model = tiny_model()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    unused = nn.Parameter(torch.randn(16, 16))
    opt = make(nn.ModuleList([model, nn.ParameterList([unused])]))
    before = frozen.detach().clone()
    train_step(model, opt, 0, 0)
    assert frozen.grad is None and torch.equal(frozen, before)
    assert unused.grad is None


def test_freezing_mid_training_moves_the_residual_into_the_gradient() -> None:
    model = tiny_model()
    opt = make(model, compressor="topk", policy="fixed", policy_options={"cf": 50})
    train_step(model, opt, 0, 0)
    mem = opt.memory
    assert isinstance(mem, ResidualMemory)
    layout = opt._layout
    assert layout is not None
    bucket = layout.compressed[0]
    residual = mem.residuals[bucket.key].clone()
    # freeze the first layer; give every other parameter a zero gradient, then step with CF 1
    model[0].weight.requires_grad_(False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    send_dense(opt)
    opt.step()
    offset = 0
    for p in bucket.params:
        piece = residual[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if p.requires_grad:
            assert torch.equal(p.grad, piece)  # type: ignore[arg-type]
        else:
            assert p.grad is None  # the frozen layer gets nothing, its residual included


@pytest.mark.parametrize("overlap", [True, False])
def test_a_parameter_resized_through_data_is_refused_by_name_and_a_new_optimizer_trains(
    overlap: bool,
) -> None:
    """``p.data = <another shape>`` keeps the parameter and changes its size under the
    layout: refused at the next step, naming the parameter and both shapes, before anything
    is packed (it raised from a bucket's residual before); an optimizer built anew over the
    resized model trains."""
    model = tiny_model()
    head = model[5]
    opt = make(model, overlap=overlap)
    train_step(model, opt, 0, 0)
    head.weight.data, head.bias.data = torch.randn(12, 32), torch.randn(12)
    resized = r"parameter 4 changed shape from \(10, 32\) to \(12, 32\)"
    for step in (1, 2):  # again at the next step: nothing was half done
        with pytest.raises(ValueError, match=resized):
            train_step(model, opt, 0, step)
    assert opt.steps == 1
    opt.close()
    fresh = make(model, overlap=overlap)
    fresh.zero_grad()
    x, y = batch(0, 3)
    nn.functional.cross_entropy(model(x), y).backward()
    fresh.step()
    assert fresh.steps == 1 and head.weight.grad is not None
    assert head.weight.grad.shape == (12, 32)


def test_a_checkpoint_saved_between_a_freeze_and_its_adoption_names_its_layout() -> None:
    """A step that sees a tensor frozen still trains on the old layout; a checkpoint saved
    before the next step holds that layout's residuals, but it was saved with the layout of
    the parameters as they were then (frozen), and a load said only that a residual
    "belongs to no bucket". Now it saves the residuals' own layout: a load over the frozen
    parameters is refused naming the case and what to do, and one over the parameters as they
    were loads."""
    model = tiny_model()
    opt = make(model, compressor="topk", policy="fixed", policy_options={"cf": 10})
    for step in range(3):
        train_step(model, opt, 0, step)
    model[0].weight.requires_grad_(False)
    train_step(model, opt, 0, 3)  # sees the freeze, trains on the old layout
    saved = opt.state_dict()
    opt.close()
    frozen = make(model, compressor="topk", policy="fixed", policy_options={"cf": 10})
    with pytest.raises(ValueError, match="saved after a tensor was frozen or a group added"):
        frozen.load_state_dict(saved)
    frozen.close()
    model[0].weight.requires_grad_(True)
    as_saved = make(model, compressor="topk", policy="fixed", policy_options={"cf": 10})
    as_saved.load_state_dict(saved)
    train_step(model, as_saved, 0, 4)
    assert as_saved.steps == 5


#: the start of the refusal of a sparse gradient (GravacOptimizer._refuse_sparse)
SPARSE_REFUSED = r"gradient of layout torch.sparse_coo .* torch.strided \(dense\) gradients only"


@pytest.mark.parametrize("overlap", [True, False])
def test_a_sparse_gradient_is_refused_at_the_first_step(overlap: bool) -> None:
    """``nn.Embedding(sparse=True)`` in the second param group: its gradient is refused before
    it is packed, not densified (SGD would take it so, SparseAdam not: test below), naming the
    parameter by its index among the wrapped optimizer's (over its groups) and its shape."""
    torch.manual_seed(0)
    lin, emb = nn.Linear(4, 4), nn.Embedding(20, 4, sparse=True)
    groups = [{"params": lin.parameters()}, {"params": emb.parameters(), "lr": 0.1}]
    opt = GravacOptimizer(torch.optim.SGD(groups, lr=0.1), compressor="topk", overlap=overlap)
    before = emb.weight.detach().clone()
    loss = lin(emb(torch.tensor([1, 2, 2, 7]))).sum()
    with pytest.raises(ValueError, match=SPARSE_REFUSED) as exc:
        loss.backward()  # the hooks launch the buckets as their gradients are ready
        opt.step()
    message = str(exc.value)
    assert message.startswith("parameter 2 (shape (20, 4))")
    assert "sparse=False" in message and "gravac_hook" in message
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse  # never densified
    assert torch.equal(emb.weight.detach(), before)


@pytest.mark.parametrize("failure", ["stale", "sparse"])
def test_an_optimizer_whose_step_failed_goes_when_dropped(failure: str) -> None:
    """A failed step (a gradient changed after its bucket was sent; a sparse gradient) leaves
    nothing that keeps the optimizer alive: dropped, it goes at once, without a garbage
    collection, and its gradient hooks with it (the failed results held the raised error, and
    through its traceback the step's frames, in torch futures, which Python's collector cannot
    see through: the optimizer lived for good)."""
    lin, emb = nn.Linear(4, 4), nn.Embedding(20, 4, sparse=failure == "sparse")
    opt = GravacOptimizer(torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.1))
    gc.disable()
    try:
        with pytest.raises((RuntimeError, ValueError), match=r"changed a gradient|sparse_coo"):
            lin(emb(torch.tensor([1, 2]))).sum().backward()  # the hooks send the buckets
            if failure == "stale":
                lin.weight.grad.mul_(2.0)  # type: ignore[union-attr]
            opt.step()
        gone = weakref.ref(opt)
        del opt
        assert gone() is None
    finally:
        gc.enable()


def test_sparse_adam_alone_is_refused() -> None:
    """The issue's case: SparseAdam would fail on a densified gradient with torch's error."""
    emb = nn.Embedding(20, 4, sparse=True)
    opt = GravacOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=SPARSE_REFUSED) as exc:
        emb(torch.tensor([3, 4])).sum().backward()
        opt.step()
    assert str(exc.value).startswith("parameter 0 (shape (20, 4))")


def test_a_sparse_gradient_is_refused_before_a_new_layout_takes_the_residuals() -> None:
    """A layout change moves the residuals into the gradients first (_flush_residuals): a sparse
    gradient there takes its residual densely (none is lost), and the step is refused all the
    same, not sent dense."""
    torch.manual_seed(0)
    lin, emb, extra = nn.Linear(8, 8, bias=False), nn.Embedding(20, 8, sparse=True), nn.Linear(8, 8)
    sgd = torch.optim.SGD([lin.weight, emb.weight, *extra.parameters()], lr=0.1)
    opt = GravacOptimizer(sgd, compressor="topk", overlap=False)
    for step in range(2):  # the embedding's gradient dense yet: it leaves a residual
        if step == 1:  # a new layout: proposed at this step, adopted at the next
            extra.weight.requires_grad_(False)
        opt.zero_grad()
        emb.weight.grad = torch.randn(20, 8)
        lin(torch.randn(4, 8)).sum().backward()
        opt.step()  # the bucket holds a residual
    opt.zero_grad()
    emb(torch.tensor([1, 5])).sum().backward()
    sparse = emb.weight.grad
    assert sparse is not None and sparse.is_sparse
    bucket = opt._layout.buckets[0]  # type: ignore[union-attr]
    residual = opt.memory.residual(bucket.key)
    assert residual is not None
    (emb_residual,) = [e for p, e in split_flat(residual, bucket.params) if p is emb.weight]
    assert bool(emb_residual.abs().sum() > 0)
    with pytest.raises(ValueError, match=SPARSE_REFUSED):
        opt.step()
    # the gradient took its residual densely; the refused step then formed x = g + e in the
    # gradient's buffer and compressed it there: Top-k's selected entries (one here) are zeroed
    taken = emb.weight.grad
    assert not taken.is_sparse
    assert int((taken != sparse.to_dense() + emb_residual).sum()) <= 1


def test_mixed_dtypes_go_to_separate_buckets() -> None:
    a = nn.Linear(32, 32)
    b = nn.Linear(32, 32).double()
    opt = GravacOptimizer(
        torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1), dense_bytes=0
    )
    a(torch.randn(4, 32)).sum().backward()
    b(torch.randn(4, 32, dtype=torch.float64)).sum().backward()
    opt.step()
    layout = opt._layout
    assert layout is not None
    assert sorted(str(bk.dtype) for bk in layout.compressed) == ["torch.float32", "torch.float64"]
    assert b.weight.grad is not None and b.weight.grad.dtype == torch.float64


@pytest.mark.parametrize(
    ("search", "tags", "windows"),
    [
        # windows of 3 steps after a warm-up of 2 (its own window): each next step carries
        # the window's gain
        ("trial", ("cf_sent", "theta_min", "gain_min", "gain_window", "wire_bytes"), [2, 6]),
        # Algorithm 1 does not read it: logged every window of 3 steps from the first
        ("paper", ("cf_sent", "cf_candidate", "theta_min", "gain_min", "comm_seconds"), [3, 6]),
        # every CF of the exponential ladder's window gain, at the steps that carry the window's
        ("shadow", ("gain_window", "gain_shadow/cf10", "gain_judged/cf1000"), [2, 6]),
    ],
)
def test_tensorboard_event_file_holds_the_tags(
    tmp_path: object, search: str, tags: tuple[str, ...], windows: list[int]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = tiny_model()
    monitor = TensorBoardMonitor(tmp_path)
    opt = make(model, monitor=monitor, search=search)
    for step in range(8):
        train_step(model, opt, 0, step)
    opt.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    found = set(acc.Tags()["scalars"])
    for tag in tags:
        assert f"gravac/{tag}" in found
    assert len(acc.Scalars("gravac/cf_sent")) == 8
    assert acc.Scalars("gravac/theta_min")[0].value == 10.0
    assert [e.step for e in acc.Scalars("gravac/gain_window")] == windows
    if search == "shadow":
        assert [e.step for e in acc.Scalars("gravac/gain_shadow/cf160")] == windows


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"compressor": "nope"}, "unknown compressor"),
        ({"policy": "nope"}, "unknown policy"),
        ({"nonfinite": "ignore"}, "nonfinite"),
        ({"theta_min": 0.1}, "theta_min"),
        ({"bucket_bytes": -1}, "bucket_bytes must be an integer >= 1 or None, got -1"),
        ({"bucket_bytes": 0}, "bucket_bytes must be an integer >= 1 or None, got 0"),
        ({"bucket_bytes": True}, "bucket_bytes must be an integer >= 1 or None, got True"),
        ({"dense_bytes": None}, "dense_bytes must be an integer >= 0, got None"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments_raise(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(tiny_model(), **kw)


@pytest.mark.parametrize(
    ("compressor", "bucket_bytes"),
    [("fp16", CAST_BUCKET_BYTES), ("bf16", CAST_BUCKET_BYTES), ("topk", DEFAULT_BUCKET_BYTES)],
)
def test_the_bucket_size_is_the_compressor_s_unless_given(
    compressor: str, bucket_bytes: int
) -> None:
    # a 3 MiB matrix: two pieces in the casts' 2 MiB buckets, one bucket in DDP's 25 MiB
    model = nn.Linear(768, 1024, bias=False)
    opt = make(model, compressor=compressor, policy="fixed", policy_options={"cf": 2})
    assert opt.bucket_bytes == bucket_bytes
    assert len(opt._fresh_layout().compressed) == (2 if bucket_bytes == CAST_BUCKET_BYTES else 1)
    given = make(model, compressor=compressor, policy="fixed", policy_options={"cf": 2},
                 bucket_bytes=DEFAULT_BUCKET_BYTES)  # fmt: skip
    assert given.bucket_bytes == DEFAULT_BUCKET_BYTES
    assert len(given._fresh_layout().compressed) == 1


def test_wrapping_a_non_optimizer_raises() -> None:
    with pytest.raises(ValueError, match=r"torch\.optim\.Optimizer"):
        GravacOptimizer(object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "search"),
    [
        ("exponential", "trial"),
        ("geometric", "trial"),
        ("exponential", "paper"),
        ("geometric", "paper"),
        ("fixed", None),
    ],
)
@pytest.mark.parametrize("compressor", __import__("gravac").compressors.names())
def test_every_compressor_under_every_policy(
    compressor: str, policy: str, search: str | None
) -> None:
    """Each compressor trains under each policy and search: candidates are evaluated (and
    sent), nothing goes NaN."""
    model = tiny_model()
    opt = make(
        model,
        compressor=compressor,
        policy=policy,
        policy_options={"cf": 20.0} if search is None else None,
        search=search,
        warmup_steps=1,
        window=2,
        epsilon=0.0,  # always send the candidate, so every CF path really runs
    )
    losses, records = [], []
    for step in range(8):
        losses.append(train_step(model, opt, 0, step % 2))
        records.append(opt.last_record)
    assert all(math.isfinite(v) for v in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    def deliverable(cf: float) -> float:
        return cf_key(opt.compressor.deliverable_cf(cf))

    if policy == "fixed":
        assert all(r is not None and r.cf_sent == deliverable(20.0) for r in records)
    elif deliverable(1000.0) > deliverable(10.0):  # the compressor has CFs to search
        sent = [(r.sent, r.cf_sent) for r in records if r is not None]
        candidate = "candidate" if search == "paper" else "min"  # a trial sends its candidate
        assert any(which == candidate and cf > deliverable(10.0) for which, cf in sent)
    else:  # one deliverable CF (none, fp16, bf16, THC's uint8 all-reduce lanes): no search
        assert all(r is not None and r.cf_sent == deliverable(10.0) for r in records)
    assert losses[-1] < losses[1]  # the same two batches repeat: training makes progress


def test_monitor_accepts_a_summary_writer(tmp_path: object) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    model = tiny_model()
    opt = make(model, monitor=writer)
    for step in range(3):
        train_step(model, opt, 0, step)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert len(acc.Scalars("gravac/cf_sent")) == 3


# TensorBoard's own writer thread ends on the same error, and Python reports that thread's
# exception on its own: the test reads gravac's warning, not the thread's report
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_monitor_that_fails_mid_run_is_dropped_with_a_warning_and_training_goes_on(
    tmp_path: object,
) -> None:
    """The log directory removed under a running TensorBoard monitor: its next write raised
    out of rank 0's step() (rank 0's step count then lagged the others', and a distributed
    run would end). Now a warning names the failure, the monitor is dropped, and training is
    that of a run without a monitor, bit for bit."""
    import shutil
    from pathlib import Path

    log_dir = Path(str(tmp_path)) / "tb"
    plain, logged = tiny_model(), tiny_model()
    ref = make(plain)
    opt = make(logged, monitor=str(log_dir))
    for step in range(3):
        train_step(plain, ref, 0, step)
        train_step(logged, opt, 0, step)
    monitor = opt.engine.monitor
    assert isinstance(monitor, TensorBoardMonitor)
    monitor.writer.flush()  # its writer thread idle: nothing written while the folder goes
    shutil.rmtree(log_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3, 120):
            train_step(plain, ref, 0, step)
            train_step(logged, opt, 0, step)
    failed = [w for w in caught if "gravac's monitor failed at step" in str(w.message)]
    assert len(failed) == 1 and "FileNotFoundError" in str(failed[0].message)
    assert opt.engine.monitor is None and opt.steps == ref.steps == 120
    for a, b in zip(plain.parameters(), logged.parameters(), strict=True):
        assert torch.equal(a, b)
    opt.close()


def test_a_monitor_directory_that_cannot_be_made_is_refused_by_name(tmp_path: object) -> None:
    """It raised the OS's error from inside TensorBoard's writer, naming no option."""
    from pathlib import Path

    (Path(str(tmp_path)) / "file").write_text("")
    where = str(Path(str(tmp_path)) / "file" / "tb")
    model = tiny_model()
    opt = make(model, monitor=where)  # one worker: opened at the first step
    with pytest.raises(ValueError, match=r"monitor='.*/file/tb': no TensorBoard log can be"):
        train_step(model, opt, 0, 0)


@pytest.mark.parametrize(("overlap", "synchronize"), [(True, False), (True, True), (False, True)])
def test_backward_with_create_graph_trains_as_backward_without_it(
    overlap: bool, synchronize: bool
) -> None:
    """``backward(create_graph=True)`` runs the hooks with grad mode on, and leaves gradients
    with a graph for ``synchronize()`` (run with grad mode on, as user code is): in-place
    work on them raised. Now they are aggregated as data (as DDP does): training is bit for
    bit that of plain ``backward()``, with one warning where the hooks meet it."""

    def trained(create_graph: bool) -> list[torch.Tensor]:
        model = tiny_model()
        opt = make(model, overlap=overlap)
        for step in range(8):
            opt.zero_grad()
            x, y = batch(0, step)
            nn.functional.cross_entropy(model(x), y).backward(create_graph=create_graph)
            if synchronize:
                opt.synchronize()
            opt.step()
        assert all(p.grad is None or not p.grad.requires_grad for p in model.parameters())
        return [p.detach().clone() for p in model.parameters()]

    want = trained(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = trained(True)
    said = [w for w in caught if "backward(create_graph=True) as data" in str(w.message)]
    assert len(said) == overlap
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def _run(
    overlap: bool, compressor: str, accumulate: int = 1, **kw: object
) -> tuple[list[torch.Tensor], list]:
    model = tiny_model()
    opt = make(model, compressor=compressor, overlap=overlap, **kw)
    records = []
    for step in range(8):
        opt.zero_grad()
        with opt.no_sync():
            for micro in range(accumulate - 1):
                x, y = batch(micro + 1, step)
                nn.functional.cross_entropy(model(x), y).backward()
        x, y = batch(0, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        records.append(opt.last_record)
    return [p.detach().clone() for p in model.parameters()], records


#: splits the tiny model's Linear(256, 32) weight (32 KiB) into 8 buckets of 4 rows
SPLIT_BYTES = 4096


@pytest.mark.parametrize(
    "bucket_bytes", [DEFAULT_BUCKET_BYTES, SPLIT_BYTES], ids=["whole", "split"]
)
@pytest.mark.parametrize("compressor", ["topk", "thc", "powersgd", "dgc", "fp16"])
def test_overlap_on_or_off_gives_bit_identical_results(compressor: str, bucket_bytes: int) -> None:
    on, rec_on = _run(True, compressor, bucket_bytes=bucket_bytes)
    off, rec_off = _run(False, compressor, bucket_bytes=bucket_bytes)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    assert [(r.cf_sent, r.sent, r.wire_bytes) for r in rec_on] == [
        (r.cf_sent, r.sent, r.wire_bytes) for r in rec_off
    ]


def test_no_sync_accumulates_as_without_overlap() -> None:
    on, _ = _run(True, "topk", accumulate=3)
    off, _ = _run(False, "topk", accumulate=3)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_accumulating_without_no_sync_raises_clearly_and_the_next_step_trains() -> None:
    """The second backward's gradients would be lost: the step raises (on every rank, from
    its agreed scalars), changes nothing, and the next step trains as usual."""
    model = tiny_model()
    opt = make(model)
    assert opt.overlap
    before = [p.detach().clone() for p in model.parameters()]
    for micro in range(2):
        x, y = batch(micro, 0)
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert opt.steps == 0
    for step in range(3):
        train_step(model, opt, 0, step)
    assert opt.steps == 3 and all(torch.isfinite(p).all() for p in model.parameters())


def test_the_hooks_go_with_the_optimizer() -> None:
    """Deleted, an optimizer leaves no hook behind: another one on the same model trains, and
    a plain backward over the model runs none of gravac."""
    model = tiny_model()
    opt = make(model)
    train_step(model, opt, 0, 0)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    again = make(model)
    for step in range(3):
        train_step(model, again, 0, step)
    assert again.steps == 3
    again.close()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()  # no optimizer: nothing of gravac
    assert again._step is None


def test_buckets_are_launched_during_backward() -> None:
    """With overlap every bucket whose gradients are all ready is on its way before step()."""
    model = tiny_model()
    opt = make(model)
    x, y = batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    assert opt._step is not None and opt._next == len(opt._units)
    opt.step()
    assert opt._step is None and opt.steps == 1


def test_a_fixed_cf_measures_no_gains_and_none_keeps_no_residual() -> None:
    """Under a fixed CF the decisions never read gains, so none are computed; none sends
    everything and keeps no residual (it would be zeros)."""
    model = tiny_model()
    opt = make(model, compressor="none", policy="fixed", policy_options={"cf": 1})
    for step in range(3):
        train_step(model, opt, 0, step)
    record = opt.last_record
    assert record is not None and math.isnan(record.gain_min_step)
    assert not opt.controller.smoothed.gain
    assert isinstance(opt.memory, NoMemory) and opt.memory.residual(0) is None


def _split_linear(cf: float) -> tuple[nn.Linear, GravacOptimizer]:
    """A Linear(64, 48) whose weight (12 KiB) is split across 4 buckets of 12 rows."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    opt = GravacOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.0),
        compressor="topk",
        policy="fixed",
        policy_options={"cf": cf},
        bucket_bytes=12 * 64 * 4,
    )
    return lin, opt


def test_each_piece_of_a_split_tensor_is_compressed_on_its_own_with_exact_error_feedback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Top-k per piece (piece 0's gradient is 1000x larger, so a top-k over the whole tensor
    would send nothing of the others), and ``g + e_old == aggregate + e_new`` exactly for every
    piece at every step, the gradient a view of the optimizer's buffer throughout; the pieces'
    aggregates and residuals always lie end to end in one buffer (never copied together)."""
    joins: list[bool] = []

    def spy(parts: list[torch.Tensor]) -> torch.Tensor | None:
        joined = join_flat(parts)
        joins.append(joined is not None)
        return joined

    monkeypatch.setattr("gravac.optimizer.join_flat", spy)
    lin, opt = _split_linear(16.0)
    layout = opt._current_layout()
    pieces = [b for b in layout.compressed if b.params[0] is lin.weight]
    assert [b.rows for b in pieces] == [(0, 12), (12, 24), (24, 36), (36, 48)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        g = torch.randn(48, 64, generator=gen)
        g[:12] *= 1000.0
        # copies: the aggregate lands in the old residuals' storage
        old = [opt.memory.residual(b.key) for b in pieces]
        old = [None if e is None else e.clone() for e in old]
        lin.weight.grad, lin.bias.grad = g.clone(), torch.zeros(48)
        opt.step()
        agg = lin.weight.grad
        assert agg is not None
        for b, e_old in zip(pieces, old, strict=True):
            start, end = b.rows  # type: ignore[misc]
            x = g[start:end] + (0 if e_old is None else e_old.view(end - start, 64))
            e_new = opt.memory.residual(b.key)
            assert e_new is not None
            assert torch.equal(x, agg[start:end] + e_new.view(end - start, 64))
            sent = agg[start:end] != 0
            assert int(sent.sum()) == 48  # 768 / 16 in every piece
            assert x[sent].abs().min() >= x[~sent].abs().max()
        ref = opt._flats[0]  # held weakly: the gradients keep it
        flat = None if ref is None else ref()
        assert flat is not None and agg.data_ptr() == flat.data_ptr()
        residuals = [opt.memory.residual(b.key) for b in pieces]
        assert join_flat([e for e in residuals if e is not None]) is not None  # one buffer
    assert len(joins) >= 4 and all(joins)


def test_freezing_moves_a_split_tensors_residual_into_its_gradient() -> None:
    lin, opt = _split_linear(50.0)
    lin.weight.grad, lin.bias.grad = torch.randn(48, 64), torch.randn(48)
    opt.step()
    layout = opt._current_layout()
    residual = torch.cat(
        [opt.memory.residual(b.key) for b in layout.compressed]  # type: ignore[misc]
    ).view(48, 64)
    assert residual.abs().sum() > 0
    lin.bias.requires_grad_(False)  # a new layout: the old one's residuals are flushed
    lin.weight.grad, lin.bias.grad = torch.zeros(48, 64), None
    send_dense(opt)
    opt.step()
    assert torch.equal(lin.weight.grad, residual)  # type: ignore[arg-type]


#: compressors of one CF, which the search cannot move (none: 1, the 16-bit casts: 2)
FIXED_CF = {"none", "fp16", "bf16"}


@pytest.mark.parametrize("name", [n for n in compressors.names() if n != "topkc"])
def test_the_search_decides_alike_whatever_the_gradients_scale(name: str) -> None:
    """The CFs the search by trial sent, step by step, are the same for gradients scaled by
    2^-80 (about 8e-25) or 2^80 as for the gradients themselves (a learning rate of 0 keeps
    them the same gradients): every quantity the search reads scales away. THC's block norms
    underflowed at 2^-80, and the search then read zero gains. TopKC is left out (its float32
    squared chunk norms: tests/compressors/test_common.py)."""

    def cfs(scale: float) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
        records = Records()
        opt = GravacOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            compressor=name,
            dense_bytes=0,
            window=3,
            warmup_steps=2,
            clock=counter_clock(),
            monitor=records,
            search="trial",
        )
        for step in range(24):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            (model(x).pow(2).mean() * scale).backward()
            opt.step()
        return [r.cf_sent for r in records.items]

    base = cfs(1.0)
    assert len(set(base)) > 1 or name in FIXED_CF  # the search moved
    assert cfs(2.0**-80) == base
    assert cfs(2.0**80) == base


def test_a_second_live_optimizer_over_the_same_parameters_is_refused_until_the_first_closes() -> (
    None
):
    """Both would aggregate each gradient (the first's hooks still fire), each with its own
    residual: training silently differed from that of the new optimizer alone (by 0.006 in
    this model's parameters after 5 steps). The new one's first step raises, naming the
    parameter; once the old one is closed it trains exactly as if there had been none, and an
    optimizer rebound to the name (the old one freed) trains too."""

    def fixed(model: nn.Module) -> GravacOptimizer:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        return GravacOptimizer(sgd, policy="fixed", policy_options={"cf": 10})

    def trained(model: nn.Module, opt: GravacOptimizer, steps: range) -> list[torch.Tensor]:
        for step in steps:
            train_step(model, opt, 0, step)
        return [p.detach().clone() for p in model.parameters()]

    alone = tiny_model()
    trained(alone, fixed(alone), range(3))
    want = trained(alone, fixed(alone), range(3, 8))

    model = tiny_model()
    old = fixed(model)
    trained(model, old, range(3))
    new = fixed(model)
    with pytest.raises(
        ValueError, match=r"parameter 0 \(shape \(4, 1, 3, 3\)\) is trained by another"
    ):
        train_step(model, new, 0, 3)
    old.close()
    new = fixed(model)
    got = trained(model, new, range(3, 8))
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    new = fixed(model)  # rebound: the one before is freed
    trained(model, new, range(8, 10))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["topk", "dgc", "randomk", "thc", "fp16", "powersgd"])
def test_on_cuda_under_deterministic_algorithms_two_runs_are_bit_identical(name: str) -> None:
    """``torch.use_deterministic_algorithms(True)`` raises at any op without a deterministic
    CUDA implementation (scatter-adds among them): every op of a step has one, and two runs
    of the search train bit for bit alike."""

    def trained() -> list[torch.Tensor]:
        model = tiny_model().cuda()
        opt = make(model, compressor=name)
        for step in range(12):
            opt.zero_grad()
            x, y = batch(0, step)
            nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        pytest.skip("cuBLAS's matmuls are deterministic with CUBLAS_WORKSPACE_CONFIG=:4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = trained(), trained()
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
