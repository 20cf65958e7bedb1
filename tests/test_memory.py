"""ResidualMemory: the error-feedback identity, and two gradient-sized buffers per bucket."""

from __future__ import annotations

import torch

from gravac import compressors
from gravac.compressors import Round
from gravac.memory import ResidualMemory

N = 1000


def _step(mem: ResidualMemory, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback step of topk: (the compensated x, the decompressed sent)."""
    c = compressors.create("topk")
    x = mem.compensate(0, g)
    payload, ctx = c.compress(x, 10.0, Round())
    sent = c.decompress(payload, ctx)
    mem.update_sent(0, x, c, payload, ctx)
    return x, sent


def test_the_identity_holds_exactly_and_g_is_not_modified() -> None:
    mem = ResidualMemory()
    gen = torch.Generator().manual_seed(0)
    e = torch.zeros(N)
    for _ in range(4):
        g = torch.randn(N, generator=gen)
        kept = g.clone()
        _, sent = _step(mem, g)
        e_new = mem.residual(0)
        assert e_new is not None and torch.equal(g, kept)
        assert torch.equal(g + e, sent + e_new)  # g + e_old == D(C(x)) + e_new, exactly
        e = e_new.clone()


def test_two_buffers_alternate_across_steps() -> None:
    """The residual and the compensated x swap storage: no new gradient-sized buffer after the
    second step (a fresh one costs page faults, and the peak stays at two)."""
    mem = ResidualMemory()
    gen = torch.Generator().manual_seed(1)
    seen = [_step(mem, torch.randn(N, generator=gen))[0].data_ptr() for _ in range(6)]
    assert len(set(seen[1:])) == 2 and seen[1] == seen[3] == seen[5]
