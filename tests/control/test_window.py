"""The window sums (gravac.control.window.WindowSums) kept over a gain's horizon of several
windows."""

from __future__ import annotations

import torch

from gravac.control.window import WindowSums, sample, window_terms


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
