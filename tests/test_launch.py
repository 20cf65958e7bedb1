"""gravac.launch: spawned workers, and what is said when one dies without a word."""

from __future__ import annotations

import os
import signal

import pytest

from gravac.launch import spawn_workers


def killed_on_rank_one(rank: int, world_size: int) -> int:
    """Rank 1 dies as the out-of-memory killer ends a process: SIGKILL, no report."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.slow
def test_a_worker_killed_by_sigkill_is_named_with_the_likely_cause() -> None:
    """It was reported as an exit code (-9) with a hint about a missing main guard, which a
    user who started too many workers for the machine's memory could not act on."""
    with pytest.raises(RuntimeError, match=r"worker 1 of 2 was killed by SIGKILL \(the kernel's "):
        spawn_workers(killed_on_rank_one, 2, timeout=120.0)
