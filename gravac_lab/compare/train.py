"""One worker's share of a ``gravac compare`` job: train in one mode, or measure the link.

:func:`train_mode` trains the workload for ``steps`` steps in one mode and returns this rank's
raw measurements; :mod:`gravac_lab.compare.report` turns rank 0's into the summary. Every mode runs
on the same seeds: the same initial weights on every rank, the same shard and the same batches
per rank.

Per step, with :func:`time.perf_counter` around each part:

* ``step_seconds``: ``zero_grad``, forward, backward and ``optimizer.step()``. DDP all-reduces
  during backward and waits for the last bucket at its end; gravac compresses during backward
  (with overlap) and finishes in ``step()``. Evaluation and data selection are off this clock.
* ``forward_backward_seconds``: ``zero_grad``, forward and backward only.
* ``lr``: the learning rate of the step, decayed after each of ``lr_milestones`` by a
  :class:`torch.optim.lr_scheduler.MultiStepLR` on the mode's optimizer (gravac's
  :class:`gravac.GravacOptimizer` itself, as a user would schedule it), off the clock.
* the mode's :class:`gravac_lab.compare.modes.StepFigures`: wire bytes; compression and
  communication seconds where the mode measures them; the CF sent and achieved where the mode
  decides one (gravac's).

After training, every rank times forward and backward of a bare copy of the model (no DDP, no
hooks, the trained weights) on the same kind of batches, all ranks at once as in training:
``compute_seconds``, the compute a step cannot avoid, measured apart from any communication.

Rank 0 evaluates every ``eval_every`` steps and after the last; every rank waits for its word
meanwhile (a broadcast), so evaluation stays off every rank's clock, and with ``stop_at`` every
rank stops alike once rank 0's evaluations have met it :data:`STOP_HOLD` times in a row.
:func:`link_throughput` all-reduces a large tensor to measure what a shaped link really moves.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gravac_lab.compare import modes, workloads
from gravac_lab.compare.config import STOP_HOLD, CompareConfig

__all__ = [
    "COMPUTE_PROBE_STEPS",
    "LINK_TEST_JOB",
    "LINK_TEST_REPEATS",
    "batch_generator",
    "link_throughput",
    "shard",
    "train_mode",
]

#: the worker job that measures the link instead of training (any other job names a mode)
LINK_TEST_JOB = "link-test"
#: seed of the model's initial weights (plus ``--seed``), the same on every rank and in every
#: mode
MODEL_SEED = 0
#: seed of rank r's batches is ``BATCH_SEED + seed + r`` (plus ``BATCH_ORDERS`` times the
#: config's ``batches``), the same in every mode
BATCH_SEED = 0
#: seeds apart of two batch orders of the same seed and rank: more than any seed plus rank, so
#: another order shares no rank's batches with an order of any seed
BATCH_ORDERS = 1_000_003
#: steps of the bare model's forward and backward timed after training (median) ...
COMPUTE_PROBE_STEPS = 10
#: ... after this many untimed ones
_COMPUTE_PROBE_WARMUP = 2
#: timed all-reduces of the link test (median), after one untimed
LINK_TEST_REPEATS = 3
#: bytes of a float32
_FLOAT32_BYTES = 4
_BITS_PER_BYTE = 8


def shard(x: Tensor, y: Tensor, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s share of a training set: every ``world_size``-th sample from its own."""
    idx = torch.arange(rank, len(y), world_size)
    return x[idx], y[idx]


def batch_generator(seed: int, rank: int, batches: int = 0) -> torch.Generator:
    """The generator of rank ``rank``'s batches for a run of ``seed`` in its batch order
    ``batches`` (:data:`BATCH_SEED`, :data:`BATCH_ORDERS`)."""
    return torch.Generator().manual_seed(BATCH_SEED + seed + rank + BATCH_ORDERS * batches)


def _compute_probe(
    workload: workloads.Workload, model: nn.Module, x: Tensor, y: Tensor, cfg: CompareConfig
) -> list[float]:
    """Seconds of forward and backward of a bare copy of ``model``, per probe step."""
    bare = workload.model()
    bare.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(BATCH_SEED)
    times = []
    dist.barrier()  # every rank computes at once, as in training
    for i in range(_COMPUTE_PROBE_WARMUP + COMPUTE_PROBE_STEPS):
        idx = torch.randint(0, len(y), (cfg.batch_size,), generator=gen)
        xb, yb = x[idx], y[idx]
        t0 = time.perf_counter()
        bare.zero_grad(set_to_none=True)
        workload.loss(bare(xb), yb).backward()
        if i >= _COMPUTE_PROBE_WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def train_mode(
    mode_name: str,
    cfg: CompareConfig,
    rank: int,
    world_size: int,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
) -> dict[str, Any]:
    """Train in mode ``mode_name``; this rank's raw measurements (see the module docstring).

    Must run inside an initialised gloo process group of ``world_size`` ranks; ``data`` is the
    workload's ``(train_x, train_y, test_x, test_y)``, the same on every rank.
    """
    mode = modes.get(mode_name)
    workload = workloads.get(cfg.workload)
    train_x, train_y, test_x, test_y = data
    train_x, train_y = shard(train_x, train_y, rank, world_size)
    torch.manual_seed(MODEL_SEED + cfg.seed)
    model = workload.model()
    session = mode.open(model, cfg)
    opt = session.optimizer
    schedule = torch.optim.lr_scheduler.MultiStepLR(opt, list(cfg.lr_milestones), cfg.lr_gamma)
    gen = batch_generator(cfg.seed, rank, cfg.batches)
    out: dict[str, list[Any]] = {
        key: []
        for key in (
            "step_seconds",
            "forward_backward_seconds",
            "wire_bytes",
            "compress_seconds",
            "comm_seconds",
            "cf_sent",
            "cf_achieved",
            "gain_step",
            "gain_window",
            "gain_shadow",
            "signal",
            "judged",
            "lr",
            "evaluations",
        )
    }
    clock = 0.0  # training seconds so far, evaluation excluded
    held = 0  # evaluations in a row at cfg.stop_at (rank 0's count)
    dist.barrier()
    for step in range(1, cfg.steps + 1):
        idx = torch.randint(0, len(train_y), (cfg.batch_size,), generator=gen)
        x, y = train_x[idx], train_y[idx]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        workload.loss(session.module(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        figures = session.after_step()
        clock += t2 - t0
        out["lr"].append(opt.param_groups[0]["lr"])  # the rate this step trained at
        schedule.step()
        out["step_seconds"].append(t2 - t0)
        out["forward_backward_seconds"].append(t1 - t0)
        out["wire_bytes"].append(figures.wire_bytes)
        out["compress_seconds"].append(figures.compress_seconds)
        out["comm_seconds"].append(figures.comm_seconds)
        out["cf_sent"].append(figures.cf_sent)
        out["cf_achieved"].append(figures.cf_achieved)
        out["gain_step"].append(figures.gain_step)
        out["gain_window"].append(figures.gain_window)
        out["gain_shadow"].append(figures.gain_shadow)
        out["signal"].append(figures.signal)
        out["judged"].append(figures.judged)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            stop = torch.zeros(1)
            if rank == 0:
                value = workload.metric(model, test_x, test_y)
                out["evaluations"].append((step, clock, value))
                recent = statistics.median(out["step_seconds"][-cfg.eval_every :])
                print(
                    f"gravac compare: {mode_name} step {step}/{cfg.steps}, "
                    f"{workload.metric_name} {value:.4f}, {recent * 1e3:.1f} ms/step",
                    file=sys.stderr,
                    flush=True,
                )
                at = cfg.stop_at is not None and workload.reached(value, cfg.stop_at)
                held = held + 1 if at else 0
                stop[0] = float(held >= STOP_HOLD)
            # rank 0's decision on every rank; evaluation stays off every rank's clock
            dist.broadcast(stop, 0)
            if stop.item():
                break
    session.close()
    compute = _compute_probe(workload, model, train_x, train_y, cfg)
    return {
        **out,
        "mode": mode_name,
        "rank": rank,
        "parameters": workloads.parameter_count(model),
        "compute_seconds": compute,
        "options": session.options(),
    }


def link_throughput(cfg: CompareConfig, world_size: int) -> dict[str, float]:
    """All-reduce ``link_test_mb`` MiB of float32 and report the median time and bus rate.

    The bus rate is NCCL-tests' ``busbw``: the tensor's bytes over the time, times
    ``2 (n - 1) / n``, the share of the tensor a ring all-reduce sends over each link, so it
    reads as the link's rate whatever the number of workers.
    """
    nbytes = cfg.link_test_mb * 2**20
    tensor = torch.ones(nbytes // _FLOAT32_BYTES)
    dist.all_reduce(tensor)  # connections and buffers: untimed
    times = []
    for _ in range(LINK_TEST_REPEATS):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    bus_bytes = nbytes * 2 * (world_size - 1) / world_size
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "gbit_per_s": bus_bytes * _BITS_PER_BYTE / seconds / 1e9,
    }
