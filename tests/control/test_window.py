"""The window sums (gravac.control.window.WindowSums) kept over a gain's horizon of several
windows."""

from __future__ import annotations

import pytest
import torch

from gravac.control.window import (
    SAMPLE_BUDGET,
    VIEW_TENSORS,
    WINDOW_STRIDE,
    Sampler,
    WindowSums,
    budget_stride,
    sample,
    sample_index,
    sample_size,
    window_terms,
)


def test_the_sums_of_the_windows_a_horizon_keeps_add_up_in_the_terms() -> None:
    """With ``clear(keep=1)`` the terms at a window's end are those of what the window and the
    one before it sent, against the residual it ends with; a third window drops the first;
    the kept window survives a checkpoint, and a state without one loads as none."""
    gen = torch.Generator().manual_seed(4)
    layers, numels = (1, 2), (512, 300)
    kept, plain = WindowSums(), WindowSums()
    sent = []
    for _ in range(3):
        window = torch.zeros(812)
        for _ in range(3):
            x, e = torch.randn(812, generator=gen), torch.randn(812, generator=gen)
            for sums in (kept, plain):
                sums.add(layers, numels, sums.taken(x, numels), e)
            window += x - e
        sent.append(window)
        kept.clear(keep=1)
        plain.clear()
    residual = torch.randn(812, generator=gen)

    def want(total: torch.Tensor) -> torch.Tensor:
        parts = zip(total.split(numels), residual.split(numels), strict=True)
        return sum(window_terms(sample(s), sample(e)) for s, e in parts)

    assert torch.allclose(kept.terms(layers, numels, residual), want(sent[2]), atol=1e-9)
    assert torch.allclose(plain.terms(layers, numels, None), torch.zeros(3, dtype=torch.float64))
    for sums in (kept, plain):
        sums.add(layers, numels, sums.taken(sent[0], numels), None)
    assert torch.allclose(kept.terms(layers, numels, residual), want(sent[2] + sent[0]))
    assert torch.allclose(plain.terms(layers, numels, residual), want(sent[0]))
    before = {k: v.clone() for k, v in plain.sent.items()}  # the terms leave the sums as they are
    assert torch.equal(plain.terms(layers, numels, residual), plain.terms(layers, numels, residual))
    assert all(torch.equal(plain.sent[k], v) for k, v in before.items())
    again = WindowSums()
    again.load_state_dict(kept.state_dict())
    assert torch.equal(again.terms(layers, numels, residual), kept.terms(layers, numels, residual))
    old = {k: v for k, v in kept.state_dict().items() if k != "earlier"}
    again.load_state_dict(old)
    assert again.earlier == []


def test_the_terms_hand_out_what_each_tensor_had_to_send_over_the_horizon() -> None:
    """With ``totals``, each tensor's sampled ``X = S + e`` (the window and the one kept before
    it) is appended, in order, for the signal share; the terms are the same either way."""
    gen = torch.Generator().manual_seed(5)
    layers, numels = (3, 7), (700, 40)
    sums, total = WindowSums(), torch.zeros(740)
    for window in range(2):
        x, e = torch.randn(740, generator=gen), torch.randn(740, generator=gen)
        sums.add(layers, numels, sums.taken(x, numels), e)
        total += x - e
        if window == 0:
            sums.clear(keep=1)
    residual = torch.randn(740, generator=gen)
    totals: list[torch.Tensor] = []
    got = sums.terms(layers, numels, residual, totals)
    assert torch.equal(got, sums.terms(layers, numels, residual))
    want = [sample(s + e) for s, e in zip(total.split(numels), residual.split(numels), strict=True)]
    assert len(totals) == 2
    for t, w in zip(totals, want, strict=True):
        assert torch.allclose(t, w, atol=1e-5)


def test_a_sparse_send_is_held_compact_and_adds_up_bit_for_bit() -> None:
    """What a sparsifier sent, ``x - e`` (mostly +0.0), is held from launch to commit as its
    other entries and their positions, a fraction of the sample; added, it gives the sums that
    ``add`` gives, bit for bit (-0.0 and NaN included). A dense send is held whole."""
    gen = torch.Generator().manual_seed(6)
    layers, numels = (4, 5), (4096, 1000)
    x = torch.randn(5096, generator=gen)
    x[0], x[1] = -0.0, float("nan")  # sent as they are: x - 0
    sent = torch.cat([torch.arange(3), torch.randperm(5096, generator=gen)[:200]])
    e = x.clone().index_fill_(0, sent, 0.0)  # what Top-k leaves
    held, plain = WindowSums(), WindowSums()
    for _ in range(2):
        send = held.sampled_send(held.taken(x, numels), e, numels)
        assert send.positions is not None and send.size == sum(map(sample_size, numels))
        assert 3 <= send.values.numel() < send.size // 8
        held.add_send(layers, numels, send)
        plain.add(layers, numels, plain.taken(x, numels), e)
    for layer in layers:
        got, want = held.sent[layer], plain.sent[layer]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    dense = held.sampled_send(held.taken(x, numels), 0.5 * x, numels)
    assert dense.positions is None and dense.values.numel() == dense.size


def test_forgotten_tensors_lose_their_sums_in_every_window_kept_and_others_keep_theirs() -> None:
    """A retired chunk's id (DDP's bucket rebuild in two levels) leaves the current and the
    earlier windows' sums; another tensor's sums and terms stay as they were."""
    sums = WindowSums()
    for layers in ((1,), (2,)):
        sums.add(layers, (64,), sums.taken(torch.ones(64), (64,)), None)
    sums.clear(keep=2)
    sums.add((1,), (64,), sums.taken(torch.ones(64), (64,)), None)
    before = sums.terms((2,), (64,), None)
    sums.forget([1, 9])
    assert 1 not in sums.sent and all(1 not in earlier for earlier in sums.earlier)
    assert torch.equal(sums.terms((2,), (64,), None), before)
    assert torch.equal(sums.terms((1,), (64,), None), torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("count", [1, VIEW_TENSORS, VIEW_TENSORS + 3])
@pytest.mark.parametrize("stride", [16, 64])
def test_a_units_sample_is_its_tensors_samples_end_to_end_whichever_way_it_is_taken(
    count: int, stride: int
) -> None:
    """Through views (few tensors, no positions held) or through cached positions (many), a
    unit's sample is each tensor's :func:`sample`, in order, bit for bit, and a padded flat
    tensor's padding is not read."""
    numels = [5000, 0, 255, 257, 16, 1, 4096, 999][:count]
    flat = torch.randn(sum(numels) + 7)  # 7 elements of padding
    sampler = Sampler(stride)
    got = sampler(flat, numels)
    parts = flat[: sum(numels)].split(numels)
    want = torch.cat([sample(t, stride) for t in parts])
    assert torch.equal(got, want)
    assert torch.equal(got, flat.index_select(0, sample_index(numels, stride, flat.device)))
    held = sampler.nbytes()
    assert (held == 0) == (count <= VIEW_TENSORS)
    sampler.prune()  # read since the last prune: kept
    assert sampler.nbytes() == held
    sampler.prune()  # not read since: dropped
    assert sampler.nbytes() == 0


@pytest.mark.parametrize("total", [0, 1, 2**20, 2**26, 2**26 + 1, 3 * 2**26, 2**31])
def test_a_layouts_stride_is_the_least_power_of_two_multiple_within_the_budget(total: int) -> None:
    """At or below ``budget * stride`` elements the base stride; above, the least
    ``stride * 2^j`` that samples at most about ``budget`` elements (a sampled block of
    16 in each 16 x stride): never more, and not twice as thin as needed."""
    stride = budget_stride(total, WINDOW_STRIDE)
    factor = stride // WINDOW_STRIDE
    assert stride % WINDOW_STRIDE == 0 and factor & (factor - 1) == 0
    assert total <= SAMPLE_BUDGET * stride
    if factor > 1:
        assert total > SAMPLE_BUDGET * stride // 2
    assert (total <= 2**26) == (stride == WINDOW_STRIDE)  # 64M elements at the base stride


def test_sums_sampled_at_another_stride_are_dropped_and_a_checkpoint_keeps_its_stride() -> None:
    """``fit`` to a layout within the budget keeps everything; to one above it, the sums go
    (they were sampled at the old stride) and the terms sample at the new one; a checkpoint
    holds its stride and loads with it, and one without a stride (an older gravac's) is at
    the base stride."""
    gen = torch.Generator().manual_seed(5)
    layers, numels = (1,), (4096,)
    sums = WindowSums()
    sums.add(layers, numels, sums.taken(torch.randn(4096, generator=gen), numels), None)
    sums.clear(keep=1)
    sums.add(layers, numels, sums.taken(torch.randn(4096, generator=gen), numels), None)
    sums.fit(SAMPLE_BUDGET * WINDOW_STRIDE)  # within the budget: nothing changes
    assert sums.stride == WINDOW_STRIDE and sums.sent and sums.earlier
    old = sums.state_dict()
    sums.fit(SAMPLE_BUDGET * WINDOW_STRIDE + 1)
    assert sums.stride == 2 * WINDOW_STRIDE and not sums.sent and not sums.earlier
    x = torch.randn(4096, generator=gen)
    sums.add(layers, numels, sums.taken(x, numels), None)
    assert sums.sent[1].numel() == sample_size(4096, 2 * WINDOW_STRIDE) == 128
    e = torch.randn(4096, generator=gen)
    want = window_terms(sample(x, 2 * WINDOW_STRIDE), sample(e, 2 * WINDOW_STRIDE))
    assert torch.allclose(sums.terms(layers, numels, e), want)
    again = WindowSums()
    again.load_state_dict(sums.state_dict())
    assert again.stride == 2 * WINDOW_STRIDE
    assert torch.equal(again.terms(layers, numels, e), sums.terms(layers, numels, e))
    older = {k: v for k, v in old.items() if k != "stride"}
    again.load_state_dict(older)
    assert again.stride == WINDOW_STRIDE and torch.equal(again.sent[1], old["sent"][0][1])
