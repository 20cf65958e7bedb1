"""ResidualMemory's work buffers: compensating in place, and reusing storage across steps."""

from __future__ import annotations

import torch

from gravac import compressors
from gravac.compressors import Round
from gravac.memory import ResidualMemory

N = 1000


def _step(mem: ResidualMemory, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback step of topk through a lent work buffer: (buffer, decompressed sent)."""
    c = compressors.create("topk")
    buf = mem.work(0, N, g.dtype, g.device)
    buf.copy_(g)
    x = mem.compensate(0, buf)
    assert x is buf  # compensated in place: no copy of the gradient
    payload, ctx = c.compress(x, 10.0, Round())
    sent = c.decompress(payload, ctx)
    mem.update_sent(0, x, c, payload, ctx)
    return buf, sent


def test_the_work_buffer_holds_g_plus_e_and_keeps_the_identity() -> None:
    mem = ResidualMemory()
    gen = torch.Generator().manual_seed(0)
    e = torch.zeros(N)
    for _ in range(4):
        g = torch.randn(N, generator=gen)
        _, sent = _step(mem, g)
        e_new = mem.residual(0)
        assert e_new is not None
        assert torch.equal(g + e, sent + e_new)  # g + e_old == D(C(x)) + e_new, exactly
        e = e_new.clone()


def test_two_buffers_alternate_across_steps() -> None:
    """The residual and the work buffer swap roles: no new gradient-sized storage after the
    second step."""
    mem = ResidualMemory()
    gen = torch.Generator().manual_seed(1)
    seen = [_step(mem, torch.randn(N, generator=gen))[0].data_ptr() for _ in range(6)]
    assert len(set(seen[1:])) == 2 and seen[1] == seen[3] == seen[5]


def test_a_buffer_not_lent_is_not_modified() -> None:
    mem = ResidualMemory()
    g = torch.randn(N)
    mem.update(0, torch.zeros(N), torch.zeros(N))  # a residual of zeros exists
    kept = g.clone()
    x = mem.compensate(0, g)
    assert x is not g and torch.equal(g, kept)
