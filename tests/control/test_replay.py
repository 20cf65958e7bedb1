"""Error feedback replayed on a sample (gravac.control.replay) against its definition and against
the real compressor's error feedback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gravac import compressors
from gravac.compressors.base import Replayable, Round, k_for_cf
from gravac.config import build_engine
from gravac.control.replay import (
    SHADOW_BUDGET,
    SHADOW_STRIDE,
    ShadowSums,
    shadow_keep,
    shadow_send,
)
from gravac.control.window import WINDOW_BLOCK, sample, window_terms
from gravac.gain import gain_from_terms
from gravac.memory import ResidualMemory

TOPK = compressors.create("topk")


def replay_step(shadows: ShadowSums, *args: Any, **kwargs: Any) -> None:
    """One committed step: :meth:`ShadowSums.replay`, then :meth:`ShadowSums.apply` (as the
    engine does at close and commit)."""
    shadows.apply(shadows.replay(*args, **kwargs))


def test_the_replayed_gradient_is_one_block_in_shadow_stride_of_x_less_the_residual() -> None:
    gen = torch.Generator().manual_seed(3)
    numels = (3000, 1024 + 5)
    g, e = torch.randn(4029, generator=gen), torch.randn(4029, generator=gen)
    shadows = ShadowSums()
    got = shadows.gradient(g + e, e, numels)
    span = WINDOW_BLOCK * SHADOW_STRIDE
    for part, want in zip(got.split([48, 21]), g.split(numels), strict=True):
        picked = [i for i in range(want.numel()) if i % span < WINDOW_BLOCK]
        assert torch.allclose(part, want[picked], atol=1e-6)
    plain = shadows.gradient(g, None, numels)
    assert plain.dtype == torch.float32 and plain.numel() == 48 + 21
    assert torch.equal(plain, torch.cat([sample(t, SHADOW_STRIDE) for t in g.split(numels)]))


def test_a_shadow_round_sends_the_top_k_of_x_and_keeps_the_rest_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    g, r = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    x, r_before = g + r, r.clone()
    kept_at, values = shadow_send(g, r, 50.0, TOPK.shadow_kept)
    assert torch.equal(r, r_before)  # the send changes nothing: a skipped step drops it
    residual = shadow_keep(g, r, kept_at)
    assert residual.data_ptr() == r.data_ptr()  # the step kept in the residual's storage
    sent = torch.zeros(1000).index_copy_(0, kept_at, values)
    assert torch.equal(sent + residual, x)  # bit for bit: each element is in one of them
    first, _ = shadow_send(g, None, 50.0, TOPK.shadow_kept)
    assert torch.equal(first, TOPK.shadow_kept(g, 50.0))
    assert torch.equal(shadow_keep(g, None, first), g.clone().index_fill_(0, first, 0))
    kept = sent.ne(0)
    assert int(kept.sum()) == k_for_cf(1000, 50.0) == 20
    assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


def test_the_shadow_of_a_cf_replays_top_k_error_feedback_exactly() -> None:
    """On a tensor that is its own sample, the shadow residual and window sum at CF 40 are
    those of the real Top-k compressor with a residual memory, step for step."""
    gen = torch.Generator().manual_seed(1)
    memory, shadows = ResidualMemory(), ShadowSums()
    sent_total = torch.zeros(16)
    for t in range(6):
        g = torch.randn(16, generator=gen)
        x = memory.compensate(0, g)
        payload, ctx = TOPK.compress(x, 4.0, Round(step=t, key=0, world_size=1))
        sent_total += TOPK.decompress(payload, ctx)
        memory.update_sent(0, x, TOPK, payload, ctx)
        replay_step(shadows, (4.0,), (7,), (16,), g, TOPK.shadow_kept, accumulate=True)
        residual = memory.residual(0)
        assert residual is not None
        assert torch.equal(shadows.residual[(4.0, (7,))], residual)
    assert torch.allclose(shadows.sent[(4.0, (7,))], sent_total, atol=1e-6)


def test_window_terms_hold_the_error_feedback_identity_for_every_cf() -> None:
    """Over a window, each CF's ``S + e_end`` is the window's gradients plus the residual it
    started with (``X``), and the terms are ``window_terms(S, e_end)`` summed over tensors; a
    higher CF delivers less of ``X``."""
    gen = torch.Generator().manual_seed(2)
    shadows, cfs, layers = ShadowSums(), (10.0, 100.0), (3, 5)
    numels = (1024 * 3, 1024 * 5)  # samples of 48 and 80 elements
    sizes = (48, 80)
    signal = torch.randn(128, generator=gen)
    for _ in range(3):  # residuals built up before the window
        g = signal + torch.randn(128, generator=gen)
        replay_step(shadows, cfs, layers, numels, g, TOPK.shadow_kept, accumulate=True)
    shadows.clear()
    start = {cf: shadows.residual[(cf, layers)].clone() for cf in cfs}
    total = torch.zeros(128)
    for _ in range(8):
        g = signal + torch.randn(128, generator=gen)
        total += g
        replay_step(shadows, cfs, layers, numels, g, TOPK.shadow_kept, accumulate=True)
    terms = shadows.terms(cfs, layers, numels)
    gains = []
    for i, cf in enumerate(cfs):
        s, e = shadows.sent[(cf, layers)], shadows.residual[(cf, layers)]
        assert torch.allclose(s + e, total + start[cf], atol=1e-5)
        want = sum(window_terms(a, b) for a, b in zip(s.split(sizes), e.split(sizes), strict=True))
        assert torch.allclose(terms[3 * i : 3 * i + 3], want)
        for k, part in zip(layers, e.split(sizes), strict=True):
            assert torch.equal(shadows.piece("residual", cf, k), part)
        gains.append(gain_from_terms(terms[3 * i : 3 * i + 3]))
    assert 0.0 < gains[1] < gains[0] <= 1.0


def test_a_closing_step_moves_the_residual_not_the_sums_and_a_new_window_keeps_residuals() -> None:
    shadows = ShadowSums()
    g = torch.tensor([3.0, 1.0, 0.5, 0.25])
    replay_step(shadows, (2.0,), (0,), (4,), g, TOPK.shadow_kept, accumulate=True)
    assert torch.equal(shadows.sent[(2.0, (0,))], torch.tensor([3.0, 1.0, 0.0, 0.0]))
    replay_step(shadows, (2.0,), (0,), (4,), g, TOPK.shadow_kept, accumulate=False)
    assert torch.equal(shadows.sent[(2.0, (0,))], torch.tensor([3.0, 1.0, 0.0, 0.0]))
    # x = g + [0, 0, .5, .25] = [3, 1, 1, .5]: 3 and one of the 1s sent
    assert float(shadows.residual[(2.0, (0,))].sum()) == pytest.approx(1.5)
    shadows.clear()
    assert shadows.sent == {} and (2.0, (0,)) in shadows.residual


def test_a_replay_changes_no_shadow_until_it_is_applied_and_then_is_the_step() -> None:
    """The engine replays at close, while the step's collectives travel, and applies at
    commit: a skipped step must leave the shadows as they were, and an applied one is one
    step of error feedback at each CF (the residual ``x`` less what was sent, the sum grown
    by it)."""
    shadows = ShadowSums()
    g = torch.tensor([3.0, -1.0, 0.5, 0.25, 2.0, -4.0, 0.0, 1.5])
    replay_step(shadows, (2.0, 4.0), (0,), (8,), g, TOPK.shadow_kept, accumulate=True)

    def held(sums: ShadowSums) -> dict[tuple[str, object], torch.Tensor]:
        stores = ("residual", "sent")
        return {(n, k): t.clone() for n in stores for k, t in getattr(sums, n).items()}

    before = held(shadows)
    pending = shadows.replay((2.0, 4.0), (0,), (8,), 2 * g, TOPK.shadow_kept, accumulate=True)
    after = held(shadows)
    assert after.keys() == before.keys() and len(before) == 4
    assert all(torch.equal(after[k], before[k]) for k in before)
    shadows.apply(pending)
    for cf in (2.0, 4.0):
        x = 2 * g + before[("residual", (cf, (0,)))]
        kept = TOPK.shadow_kept(x, cf)
        sent = torch.zeros(8).index_copy_(0, kept, x.index_select(0, kept))
        assert torch.equal(shadows.residual[(cf, (0,))], x - sent)
        assert torch.equal(shadows.sent[(cf, (0,))], before[("sent", (cf, (0,)))] + sent)


def test_cfs_no_longer_asked_about_are_dropped() -> None:
    shadows = ShadowSums()
    g = torch.ones(8)
    replay_step(shadows, (2.0, 4.0), (0,), (8,), g, TOPK.shadow_kept, accumulate=True)
    replay_step(shadows, (4.0,), (0,), (8,), g, TOPK.shadow_kept, accumulate=True)
    assert set(shadows.residual) == set(shadows.sent) == {(4.0, (0,))}


def test_state_round_trip_and_another_version_starts_afresh() -> None:
    shadows = ShadowSums()
    g = torch.arange(10.0)
    replay_step(shadows, (2.0,), (1, 3), (6, 4), g, TOPK.shadow_kept, accumulate=True)
    state = shadows.state_dict()
    assert [(cf, layers, sizes, t.numel()) for cf, layers, sizes, t in state["residual"]] == [
        (2.0, [1, 3], [6, 4], 10)
    ]
    again = ShadowSums()
    again.load_state_dict(state)
    for name in ("residual", "sent"):
        for layer in (1, 3):
            assert torch.equal(again.piece(name, 2.0, layer), shadows.piece(name, 2.0, layer))
    # joined into its unit at first use, and replayed as before
    replay_step(shadows, (2.0,), (1, 3), (6, 4), g, TOPK.shadow_kept, accumulate=True)
    replay_step(again, (2.0,), (1, 3), (6, 4), g, TOPK.shadow_kept, accumulate=True)
    assert torch.equal(again.residual[(2.0, (1, 3))], shadows.residual[(2.0, (1, 3))])
    assert torch.equal(again.sent[(2.0, (1, 3))], shadows.sent[(2.0, (1, 3))])
    # saved and loaded again from the pieces held by layer: the same pieces
    loaded = ShadowSums()
    loaded.load_state_dict(state)
    relayed = loaded.state_dict()
    assert [row[:3] for row in relayed["residual"]] == [(2.0, [1, 3], [6, 4])]
    assert torch.equal(relayed["residual"][0][3], state["residual"][0][3])
    again.load_state_dict({**state, "version": 0})
    assert again.state_dict()["residual"] == [] and again.state_dict()["sent"] == []


def test_a_state_of_the_first_version_a_tensor_per_layer_still_loads() -> None:
    shadows = ShadowSums()
    g = torch.arange(10.0)
    replay_step(shadows, (2.0,), (1, 3), (6, 4), g, TOPK.shadow_kept, accumulate=True)
    pieces = [
        (cf, layer, shadows.piece(name, cf, layer).clone())
        for name in ("residual",)
        for cf, layer in ((2.0, 1), (2.0, 3))
    ]
    old = ShadowSums()
    old.load_state_dict({"version": 1, "residual": pieces, "sent": [], "earlier": []})
    for layer in (1, 3):
        assert torch.equal(old.piece("residual", 2.0, layer), shadows.piece("residual", 2.0, layer))


def test_a_new_layout_joins_its_units_from_the_tensors_pieces() -> None:
    """Tensors 1 and 3 were one unit; after a rebuild 3 shares a unit with a new tensor 5 and
    1 is alone: each keeps its own shadow residual, and 5 starts from zeros."""
    shadows = ShadowSums()
    replay_step(
        shadows,
        (2.0,),
        (1, 3),
        (6, 4),
        torch.arange(10.0).flip(0),
        TOPK.shadow_kept,
        accumulate=True,
    )
    one, three = shadows.piece("residual", 2.0, 1), shadows.piece("residual", 2.0, 3)
    assert one is not None and three is not None
    one, three = one.clone(), three.clone()
    assert torch.equal(three, torch.tensor([3.0, 2.0, 1.0, 0.0]))  # none of it sent
    terms = shadows.terms((2.0,), (3, 5), (4, 2))  # a window closes first in the new layout
    assert torch.allclose(
        terms, window_terms(shadows.sent[(2.0, (3, 5))], shadows.residual[(2.0, (3, 5))])
    )
    assert torch.equal(shadows.residual[(2.0, (3, 5))], torch.cat([three, torch.zeros(2)]))
    replay_step(shadows, (2.0,), (1,), (6,), torch.zeros(6), TOPK.shadow_kept, accumulate=False)
    # tensor 1's residual carried on: a zero gradient sends the top half of it
    want = one.clone().index_fill_(0, TOPK.shadow_kept(one, 2.0), 0)
    assert torch.equal(shadows.residual[(2.0, (1,))], want) and bool(one.ne(want).any())
    assert set(shadows.residual) == {(2.0, (3, 5)), (2.0, (1,))}


def test_sample_indices_of_a_layout_no_window_read_are_dropped() -> None:
    """A bucket rebuild changes a unit's layout: its old indices go at the end of the first
    window that did not read them, and those read in the window that ends stay. (Units of
    more than VIEW_TENSORS tensors: fewer are sampled through views, with no indices.)"""
    shadows = ShadowSums()
    x = torch.arange(2000.0)
    old = shadows.gradient(x, None, (300,) * 6 + (200,))
    assert shadows.nbytes() == old.numel() * 4  # int32 indices, nothing replayed yet
    shadows.clear()  # the window that read the old layout ends
    new = shadows.gradient(x, None, (400,) * 5)
    assert shadows.nbytes() == (old.numel() + new.numel()) * 4
    shadows.clear()  # a window that read only the new layout
    assert shadows.nbytes() == new.numel() * 4
    assert torch.equal(shadows.gradient(x, None, (400,) * 5), new)
    assert shadows.gradient(x, None, (2000,)).numel() > 0
    assert shadows.nbytes() == new.numel() * 4  # one tensor: sampled through views


@pytest.mark.parametrize("name", ["topk", "redsync", "dgc"])
def test_the_sparsifiers_replay_as_an_exact_top_k(name: str) -> None:
    c = compressors.create(name)
    assert isinstance(c, Replayable)
    x = torch.tensor([0.1, -5.0, 0.3, 2.0, -0.2, 0.0, 1.0, 0.05])
    assert sorted(c.shadow_kept(x, 4.0).tolist()) == [1, 3]


@pytest.mark.parametrize("name", ["none", "fp16", "thc", "powersgd", "randomk", "topkc"])
def test_other_compressors_cannot_be_replayed(name: str) -> None:
    c = compressors.create(name)
    assert not isinstance(c, Replayable)
    with pytest.raises(ValueError, match="search='shadow' needs a compressor whose sends can be"):
        build_engine(compressor=name, search="shadow")


def test_sums_kept_for_the_horizon_add_the_windows_before_to_the_terms() -> None:
    """``clear(keep=1)``: the next window's terms are those of ``S`` summed over both windows
    (the closing step between them sends nothing to either, as in one window) against the
    residual the second ends with; one more window drops the first; ``keep=0`` forgets."""
    gen = torch.Generator().manual_seed(5)
    cfs, layers, numels = (10.0, 100.0), (2, 4), (1024 * 3, 1024 * 2)
    kept, plain = ShadowSums(), ShadowSums()
    sent = {cf: [torch.zeros(80), torch.zeros(80), torch.zeros(80)] for cf in cfs}
    for window in range(3):
        for step in range(4):
            g = torch.randn(80, generator=gen)
            closing = step == 3
            for sums in (kept, plain):
                held = {cf: sums.residual.get((cf, layers)) for cf in cfs}
                before = {cf: None if r is None else r.clone() for cf, r in held.items()}
                replay_step(sums, cfs, layers, numels, g, TOPK.shadow_kept, accumulate=not closing)
            if not closing:
                for cf in cfs:
                    x = g if before[cf] is None else g + before[cf]
                    sent[cf][window] += x - plain.residual[(cf, layers)]
        if window < 2:
            kept.clear(keep=1)
            plain.clear()
    got, alone = kept.terms(cfs, layers, numels), plain.terms(cfs, layers, numels)
    for i, cf in enumerate(cfs):
        e = plain.residual[(cf, layers)]
        assert torch.equal(kept.residual[(cf, layers)], e)
        both = sent[cf][1] + sent[cf][2]
        want = sum(window_terms(a, b) for a, b in zip(both.split(48), e.split(48), strict=True))
        assert torch.allclose(got[3 * i : 3 * i + 3], want)
        last = sent[cf][2]
        want = sum(window_terms(a, b) for a, b in zip(last.split(48), e.split(48), strict=True))
        assert torch.allclose(alone[3 * i : 3 * i + 3], want)
    again = ShadowSums()
    again.load_state_dict(kept.state_dict())
    assert torch.equal(again.terms(cfs, layers, numels), got)  # the earlier window survives
    assert kept.nbytes() > plain.nbytes()
    kept.clear()
    assert kept.earlier == []


def test_forgotten_tensors_lose_every_shadow_of_their_units_and_others_keep_theirs() -> None:
    """A retired chunk's id (DDP's bucket rebuild in two levels): the shadows of units that
    hold it, in every store and the earlier windows, go; another unit's stay bit for bit."""
    shadows = ShadowSums()
    g = torch.arange(8.0)
    for layers in ((1,), (2,)):
        replay_step(shadows, (2.0,), layers, (8,), g, TOPK.shadow_kept, accumulate=True)
    shadows.clear(keep=1)
    kept = shadows.residual[(2.0, (2,))].clone()
    shadows.forget([1])
    held = [*shadows.residual, *shadows.sent]
    assert all(1 not in unit for _, unit in held)
    assert all(layer != 1 for earlier in shadows.earlier for _, layer in earlier)
    assert torch.equal(shadows.residual[(2.0, (2,))], kept)
    assert any(layer == 2 for earlier in shadows.earlier for _, layer in earlier)


def test_shadows_sampled_at_another_stride_start_afresh_and_a_checkpoint_keeps_its_stride() -> None:
    """A layout within :data:`SHADOW_BUDGET` keeps the base stride and every shadow; one above
    it drops them all (sampled at the old stride), and the replayed gradient is sampled at the
    new one; a checkpoint holds its stride and loads with it, one without (an older gravac's)
    at the base stride."""
    gen = torch.Generator().manual_seed(6)
    numels = (2048,)
    shadows = ShadowSums()
    g = shadows.gradient(torch.randn(2048, generator=gen), None, numels)
    replay_step(shadows, (4.0,), (0,), numels, g, TOPK.shadow_kept, accumulate=True)
    shadows.clear(keep=1)
    shadows.fit(SHADOW_BUDGET * SHADOW_STRIDE)
    assert shadows.stride == SHADOW_STRIDE and shadows.residual and shadows.earlier
    old = shadows.state_dict()
    shadows.fit(SHADOW_BUDGET * SHADOW_STRIDE + 1)
    assert shadows.stride == 2 * SHADOW_STRIDE
    assert not (shadows.residual or shadows.sent or shadows.earlier)
    x = torch.randn(2048, generator=gen)
    g = shadows.gradient(x, None, numels)
    assert torch.equal(g, sample(x, 2 * SHADOW_STRIDE)) and g.numel() == 16
    replay_step(shadows, (4.0,), (0,), numels, g, TOPK.shadow_kept, accumulate=True)
    again = ShadowSums()
    again.load_state_dict(shadows.state_dict())
    assert again.stride == 2 * SHADOW_STRIDE
    assert torch.equal(again.terms((4.0,), (0,), numels), shadows.terms((4.0,), (0,), numels))
    again.load_state_dict({k: v for k, v in old.items() if k != "stride"})
    assert again.stride == SHADOW_STRIDE
    assert torch.equal(again.piece("residual", 4.0, 0), old["residual"][0][3])
