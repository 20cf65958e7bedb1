"""One rank of a 2-rank gloo run in which rank 1 fails at step :data:`FAULT_STEP`.

Run by ``tests/test_faults.py``, once per rank, as ``python -m tests.faulty_peer FRONT FAULT
TIMEOUT FAULT_AT`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set:

* ``FRONT``: ``optimizer`` (:class:`gravac.GravacOptimizer`) or ``ddp`` (DDP with
  :func:`gravac.ddp.gravac_hook`);
* ``FAULT``: what rank 1 does at the start of that step: ``kill`` (SIGKILL itself), ``stop``
  (SIGSTOP itself) or ``sleep`` (sleep for :data:`SLEEP` seconds); it first writes the wall
  clock time to the file ``FAULT_AT``;
* ``TIMEOUT``: gravac's ``step_timeout`` in seconds, or ``none``.

Rank 0 trains on, and ends as an uncaught gravac error ends it (the test reads its exit status
and stderr).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gravac import GravacOptimizer
from gravac.ddp import GravacHookState, gravac_hook
from tests.helpers import batch, tiny_model

#: the step (0-based) at whose start rank 1 fails; the steps before it complete on both ranks
FAULT_STEP = 2
#: steps rank 0 would take (it fails at FAULT_STEP)
STEPS = 5
#: seconds a sleeping rank 1 sleeps: far past any step timeout the tests use
SLEEP = 600.0


def fail(fault: str, fault_at: Path) -> None:
    """Rank 1's failure: write the time, then kill, stop or put this process to sleep."""
    fault_at.write_text(repr(time.time()))
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault == "sleep":
        time.sleep(SLEEP)
    else:
        raise ValueError(f"fault must be kill, stop or sleep, got {fault!r}")


def main(front: str, fault: str, timeout: str, fault_at: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    options = {} if timeout == "none" else {"step_timeout": float(timeout)}
    model = tiny_model()
    net: nn.Module = model
    if front == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(GravacHookState(**options), gravac_hook)
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **options)
    for step in range(STEPS):
        if rank == 1 and step == FAULT_STEP:
            fail(fault, Path(fault_at))
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


if __name__ == "__main__":
    main(*sys.argv[1:])
