"""The tests' pools of spawned gloo groups (tests.workers): a failure anywhere tears the pool
down without hanging, and the next scenario gets a fresh pool (checked once, on 2 ranks)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.workers import Workers

pytestmark = pytest.mark.slow


def _sum_of_ranks(rank: int, world_size: int) -> tuple[int, int]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return int(t.item()), os.getpid()


def _raise_on_last_rank(rank: int, world_size: int) -> None:
    if rank == world_size - 1:
        raise ValueError("scenario failed on purpose")
    dist.all_reduce(torch.zeros(1))  # never met by the last rank: waits until killed


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _leave_the_group(rank: int, world_size: int) -> int:
    dist.destroy_process_group()
    return rank


def test_scenarios_share_one_group_of_processes(gloo_pools: Workers) -> None:
    first = gloo_pools.run(_sum_of_ranks, 2)
    second = gloo_pools.run(_sum_of_ranks, 2)
    assert [s for s, _ in first] == [s for s, _ in second] == [1, 1]
    assert [pid for _, pid in first] == [pid for _, pid in second]  # the same two processes
    assert len({pid for _, pid in first}) == 2


def test_a_rank_that_raises_tears_the_pool_down_and_the_next_run_starts_a_new_one(
    gloo_pools: Workers,
) -> None:
    before = gloo_pools.run(_sum_of_ranks, 2)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)worker 1 failed.*scenario failed on purpose"):
        gloo_pools.run(_raise_on_last_rank, 2, timeout=120.0)
    assert time.monotonic() - started < 60.0  # not gloo's 30-minute timeout
    assert not gloo_pools.pools[2].alive
    after = gloo_pools.run(_sum_of_ranks, 2)
    assert [s for s, _ in after] == [1, 1]
    assert {pid for _, pid in after}.isdisjoint(pid for _, pid in before)


def test_a_scenario_past_its_timeout_tears_the_pool_down(gloo_pools: Workers) -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 did not finish in 1.0 s"):
        gloo_pools.run(_sleep, 1, 60.0, timeout=1.0)
    assert not gloo_pools.pools[1].alive


def test_a_scenario_that_leaves_the_group_ends_the_pool_after_its_results(
    gloo_pools: Workers,
) -> None:
    assert gloo_pools.run(_leave_the_group, 1) == [0]
    assert not gloo_pools.pools[1].alive
