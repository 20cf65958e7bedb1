"""BufferPool: a buffer is handed out again only once nothing handed out on it is alive."""

from __future__ import annotations

import torch

from gravac.kernels.buffers import POOL_DEPTH, BufferPool, is_sole

CPU = torch.device("cpu")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr()


def test_a_released_buffer_is_reused() -> None:
    pool = BufferPool()
    first = pool.empty(1000, torch.float32, CPU, "t")
    ptr = first.data_ptr()
    del first
    assert pool.empty(1000, torch.float32, CPU, "t").data_ptr() == ptr


def test_a_held_buffer_or_a_view_of_it_is_not_reused() -> None:
    pool = BufferPool()
    held = pool.empty(1000, torch.float32, CPU, "t")
    assert not _same_memory(pool.empty(1000, torch.float32, CPU, "t"), held)
    ptr = held.data_ptr()
    view = held[10:20]
    array = held.numpy()
    del held
    for keeper in ("view", "array"):
        assert pool.empty(1000, torch.float32, CPU, "t").data_ptr() != ptr, keeper
        if keeper == "view":
            del view
        else:
            del array
    assert pool.empty(1000, torch.float32, CPU, "t").data_ptr() == ptr


def test_keys_are_apart_and_at_most_depth_buffers_are_tracked() -> None:
    pool = BufferPool()
    a = pool.empty(1000, torch.float32, CPU, "a")
    b = pool.empty(1000, torch.float32, CPU, "b")
    c = pool.empty(1000, torch.float16, CPU, "a")
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    held = [pool.empty(64, torch.float32, CPU, "d") for _ in range(POOL_DEPTH + 2)]
    ptrs = [t.data_ptr() for t in held]
    del held
    # the oldest two were dropped from the pool when the last two were allocated
    again = {pool.empty(64, torch.float32, CPU, "d").data_ptr() for _ in range(POOL_DEPTH)}
    assert again <= set(ptrs[-POOL_DEPTH:])


def test_a_tensor_is_sole_while_nothing_else_shares_all_of_its_memory() -> None:
    """``is_sole``: a fresh tensor is, until a view, another tensor on its memory or a NumPy
    array of it exists; a slice of a larger tensor never is."""
    t = torch.randn(6, 4)
    assert is_sole(t)
    view = t.view(-1)
    assert not is_sole(t) and not is_sole(view)
    del view
    other = t.detach()
    assert not is_sole(t)
    del other
    array = t.numpy()
    assert not is_sole(t)
    del array
    assert is_sole(t)
    assert not is_sole(torch.randn(10)[2:5].clone()[:2])
