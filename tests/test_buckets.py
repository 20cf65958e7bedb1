"""Gradients as views of their bucket's flat buffer (gather_grads / scatter_grads), and tensors
larger than a bucket split across buckets (build_layout, join_flat)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from gravac import GravacOptimizer
from gravac.buckets import (
    DEFAULT_BUCKET_BYTES,
    MAX_SMALL_BUCKETS,
    Bucket,
    build_layout,
    check_params,
    default_bucket_bytes,
    gather_grads,
    join_flat,
    scatter_grads,
    split_flat,
)
from tests.helpers import batch, counter_clock, tiny_model, train_step


def _bucket(*params: torch.Tensor) -> Bucket:
    return Bucket(0, tuple(params), torch.float32)


def _shares(g: torch.Tensor, flat: torch.Tensor) -> bool:
    return g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_gather_packs_and_binds_the_gradients_as_views() -> None:
    a, b, c = (nn.Parameter(torch.randn(3, 4)) for _ in range(3))
    a.grad, b.grad = torch.randn(3, 4), torch.randn(3, 4)  # c has none
    want = torch.cat([a.grad.reshape(-1), b.grad.reshape(-1), torch.zeros(12)])
    flat = gather_grads(_bucket(a, b, c), torch.full((36,), 9.0))
    assert torch.equal(flat, want)
    assert _shares(a.grad, flat) and _shares(b.grad, flat) and c.grad is None
    a.grad.add_(1.0)  # a view: writes land in the buffer
    assert flat[0] == want[0] + 1.0


def test_autograd_accumulates_into_the_buffer() -> None:
    lin = nn.Linear(4, 3)
    lin(torch.randn(2, 4)).sum().backward()
    flat = gather_grads(_bucket(lin.weight, lin.bias), torch.empty(15))
    before = flat.clone()
    lin(torch.randn(2, 4)).sum().backward()  # accumulates in place, into the views
    assert _shares(lin.weight.grad, flat) and not torch.equal(flat, before)
    assert torch.equal(flat[:12], lin.weight.grad.reshape(-1))


def test_other_dtypes_are_copied_not_bound() -> None:
    lin = nn.Parameter(torch.randn(5, 2))
    lin.grad = torch.randn(5, 2)
    half = nn.Parameter(torch.randn(4, dtype=torch.float16))
    half.grad = torch.randn(4, dtype=torch.float16)
    flat = gather_grads(_bucket(lin, half), torch.empty(14))
    assert torch.equal(flat[10:], half.grad.float()) and half.grad.dtype == torch.float16
    flat.fill_(2.0)  # the aggregate
    scatter_grads(_bucket(lin, half), flat)
    assert _shares(lin.grad, flat)
    assert half.grad.dtype == torch.float16 and bool((half.grad == 2.0).all())


def test_gather_adds_plus_to_every_kind_of_gradient_in_the_same_pass() -> None:
    """``plus`` (the residual) is added to a fresh, a bound, a missing and a 16-bit gradient
    alike: ``flat = g + plus``, bit for bit as a copy and then an addition."""
    fresh, bound, missing = (nn.Parameter(torch.randn(2, 2)) for _ in range(3))
    half = nn.Parameter(torch.randn(3, dtype=torch.float16))
    fresh.grad, half.grad = torch.randn(2, 2), torch.randn(3, dtype=torch.float16)
    bucket = _bucket(fresh, bound, missing, half)
    flat = torch.empty(15)
    bound.grad = torch.randn(2, 2)
    gather_grads(bucket, flat)  # binds fresh's and bound's gradients to the buffer
    bound.grad.add_(1.0)
    fresh.grad = torch.randn(2, 2)  # a new one, as after zero_grad(set_to_none=True)
    assert _shares(bound.grad, flat) and not _shares(fresh.grad, flat)
    grads = [fresh.grad, bound.grad, torch.zeros(2, 2), half.grad]
    plus = torch.randn(15)
    want = torch.cat([g.reshape(-1).float() for g in grads]) + plus
    gather_grads(bucket, flat, plus=plus)
    assert torch.equal(flat, want)
    assert _shares(fresh.grad, flat) and missing.grad is None


def test_scatter_gives_a_missing_gradient_its_piece() -> None:
    a = nn.Parameter(torch.randn(2, 2))
    flat = torch.arange(4.0)
    scatter_grads(_bucket(a), flat)
    assert a.grad is not None and _shares(a.grad, flat)
    assert [torch.equal(part, a.grad) for _, part in split_flat(flat, [a])] == [True]


def test_set_to_none_or_zeroing_train_identically() -> None:
    """Fresh gradients (set_to_none) are copied into the buffers and rebound each step; zeroed
    ones accumulate into the buffers directly: the same training, bit for bit (the search on a
    counter clock: on the wall clock, a step slowed by the machine's load could send another
    CF)."""
    models = []
    for set_to_none in (True, False):
        model = tiny_model()
        opt = GravacOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), compressor="topk", clock=counter_clock()
        )
        for step in range(4):
            opt.zero_grad(set_to_none=set_to_none)
            x, y = batch(0, step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        models.append(model)
    for pa, pb in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_after_a_step_the_gradients_are_the_aggregate_in_the_buffers() -> None:
    model = tiny_model()
    opt = GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compressor="topk")
    train_step(model, opt, 0, 0)
    flats = [None if ref is None else ref() for ref in opt._flats]  # held weakly
    for p in model.parameters():
        assert p.grad is not None and any(f is not None and _shares(p.grad, f) for f in flats)


@pytest.mark.parametrize("bucket_bytes", [1, 2**20])
def test_zero_grad_set_to_none_frees_the_buffers_of_one_tensor(bucket_bytes: int) -> None:
    """The optimizer holds the gradient buffer (the last aggregate) of a bucket of one tensor
    only through its gradient: once ``zero_grad(set_to_none=True)`` drops that, the buffer is
    freed before backward makes the fresh gradient (held, it was one gradient more at the
    peak: issue 33 item 10), which becomes the next buffer. A bucket of several tensors keeps
    its buffer (their fresh gradients are copied into it bucket by bucket; a new one at every
    step would fault its pages in anew). One byte a bucket: the large tensors alone (the small
    ones share one); 1 MiB: none alone."""
    model = tiny_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GravacOptimizer(sgd, compressor="topk", bucket_bytes=bucket_bytes, dense_bytes=0)
    for step in range(2):
        train_step(model, opt, 0, step)
    layout = opt._layout
    assert layout is not None
    alone = {id(p): len(run.bucket.params) == 1 for run in layout.runs for p in run.bucket.params}
    params = list(model.parameters())
    owners = [weakref.ref(p.grad if p.grad._base is None else p.grad._base) for p in params]  # type: ignore[union-attr]
    assert all(owner() is not None for owner in owners)
    opt.zero_grad(set_to_none=True)
    freed = [owner() is None for owner in owners]
    assert freed == [alone[id(p)] for p in params]
    assert any(freed) == (bucket_bytes == 1) and not all(freed)


def test_a_fresh_gradient_alone_in_its_bucket_becomes_the_buffer() -> None:
    """A fresh gradient (the first backward's, or after ``zero_grad(set_to_none=True)``) that
    fills its bucket alone is not copied into a buffer of the optimizer's: ``x = g + e`` is
    formed in it, and it becomes the residual. One whose memory another tensor shares (a view
    kept elsewhere) is copied, and left as it was."""
    lin = nn.Linear(64, 48, bias=False)
    fresh: list[int] = []  # where each backward's gradient is, before the optimizer's hook
    lin.weight.register_post_accumulate_grad_hook(lambda p: fresh.append(p.grad.data_ptr()))
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    opt = GravacOptimizer(sgd, compressor="topk", policy="fixed", policy_options={"cf": 10})
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        lin(x).square().mean().backward()  # launched by the optimizer's hook
        opt.step()
        residual = opt.memory.residual(0)
        assert residual is not None and residual.data_ptr() == fresh[-1]
    opt.zero_grad(set_to_none=True)
    g = lin.weight.grad = torch.randn(48, 64, generator=gen)  # launched by step()
    kept, before = g.view(-1), g.clone()
    opt.step()
    residual = opt.memory.residual(0)
    assert residual is not None and residual.data_ptr() != g.data_ptr()
    assert torch.equal(g, before) and kept.data_ptr() == g.data_ptr()


def test_a_tensor_larger_than_a_bucket_is_split_by_rows_into_buckets_of_its_own() -> None:
    """A 10 x 3 float32 weight (120 bytes) under 40-byte buckets: 4 pieces of 3, 3, 2, 2 rows
    (3 rows of 12 bytes fit a bucket), each within the size; a one-row tensor stays whole."""
    small = nn.Parameter(torch.randn(2, 2))
    big = nn.Parameter(torch.randn(10, 3))
    row = nn.Parameter(torch.randn(1, 20))
    layout = build_layout([small, big, row], bucket_bytes=40, dense_bytes=0)
    pieces = [b for b in layout.compressed if b.params[0] is big]
    assert [b.rows for b in pieces] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [b.shapes for b in pieces] == [(torch.Size((n, 3)),) for n in (3, 3, 2, 2)]
    assert all(b.numel * 4 <= 40 for b in pieces)
    assert [b.key for b in layout.compressed] == list(range(len(layout.compressed)))
    whole = [b for b in layout.compressed if b.params[0] is row]
    assert len(whole) == 1 and whole[0].rows is None and whole[0].shapes == (row.shape,)
    runs = layout.runs
    (split,) = [r for r in runs if r.bucket.params[0] is big]
    assert split.bucket.rows is None and split.bucket.numel == 30
    assert split.sizes == (9, 9, 6, 6)
    assert [i for r in runs for i in range(r.first, r.stop)] == list(range(len(layout.buckets)))


def test_join_flat_views_parts_that_lie_end_to_end_and_nothing_else() -> None:
    buf = torch.arange(10.0)
    a, b, c = buf.split([3, 3, 4])
    joined = join_flat([a, b, c])
    assert joined is not None and joined.data_ptr() == buf.data_ptr()
    assert torch.equal(joined, buf)
    assert join_flat([b, c]) is not None and torch.equal(join_flat([b, c]), buf[3:])  # type: ignore[arg-type]
    assert join_flat([a, c]) is None  # a gap
    assert join_flat([b, a]) is None  # out of order
    assert join_flat([a, torch.arange(3.0)]) is None  # another storage
    assert join_flat([a, buf.double()[3:6]]) is None  # another dtype


def _meta(*shape: int, trainable: bool = True) -> torch.Tensor:
    return torch.empty(shape, device="meta", requires_grad=trainable)


def test_a_preferred_bucket_size_grows_with_the_model_up_to_ddp_s() -> None:
    small = 2 * 2**20
    mib = 2**18  # float32 elements in a MiB
    # 8 MiB of matrices (neither the bias nor a frozen matrix counts): the preferred size holds
    params = [_meta(8, mib), _meta(10**6), _meta(200, mib, trainable=False)]
    assert default_bucket_bytes(small, params) == small
    # 200 MiB: a sixteenth of it
    params = [_meta(200, mib)]
    assert default_bucket_bytes(small, params) == 200 * 2**20 // MAX_SMALL_BUCKETS
    # 1 GiB: DDP's 25 MiB at most; no preferred size: DDP's
    assert default_bucket_bytes(small, [_meta(1024, mib)]) == DEFAULT_BUCKET_BYTES
    assert default_bucket_bytes(None, [_meta(8, mib)]) == DEFAULT_BUCKET_BYTES


def test_a_meta_parameter_is_refused_by_name_at_construction_and_in_an_added_group() -> None:
    """A parameter on the meta device (never materialized) is refused naming it, where torch
    raised from deep inside the step about a gradient's device."""
    model = tiny_model()
    ghost = nn.Parameter(torch.empty(3, 3, device="meta"))
    refused = r"parameter 6 \(shape \(3, 3\), torch.float32\) is on the meta device"
    with pytest.raises(ValueError, match=refused):
        GravacOptimizer(torch.optim.SGD([*model.parameters(), ghost], lr=0.1))
    opt = GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), clock=counter_clock())
    train_step(model, opt, 0, 0)
    with pytest.raises(ValueError, match=refused):
        opt.add_param_group({"params": [ghost]})
    assert len(opt.param_groups) == 1  # not added: the optimizer trains on
    train_step(model, opt, 0, 1)
    assert opt.steps == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_parameters_on_two_devices_are_refused_by_name() -> None:
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4, device="cuda"))]
    with pytest.raises(ValueError, match=r"parameter 1 .* is on cuda:0, parameter 0 on cpu"):
        check_params(params)
