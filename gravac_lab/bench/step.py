"""``gravac bench step``: what gravac adds to a training step of a real model, on one device.

Issue 37 asks what gravac costs a step on a GPU: its own work (compression, error feedback,
bookkeeping) against a plain step, at world size 1, where no link hides or adds anything. On a
one-process gloo group (the device's tensors; gloo moves CUDA tensors through the host), four
copies of a workload's model (:mod:`gravac_lab.compare.workloads`, the same initial weights)
train on the same batches, one step each in turn within every repeat, so that a drift of the
machine's pace falls on all of them alike:

* ``sgd``: plain ``torch.optim.SGD`` (momentum 0.9), no communication;
* ``optimizer``: :class:`gravac.GravacOptimizer` around the same SGD;
* ``ddp``: ``DistributedDataParallel`` with its own all-reduce, then SGD;
* ``hook``: the same DDP with :func:`gravac.ddp.gravac_hook`.

A step is ``zero_grad(set_to_none=True)``, forward, loss, backward and ``step()``, the device
synchronised before the clock stops. gravac sends Top-k at a static CF (``--cf``, 100 by
default) or runs its default search (``--policy default``). Each gravac front is reported against
its plain counterpart (``optimizer`` against ``sgd``, ``hook`` against ``ddp``) as the ratio of
the median step times and as ``extra = ratio - 1``, gravac's share of a plain step (issue 37's
target: at most 0.10 at world size 1 with Top-k CF 100). With ``workers > 1`` the processes
share the device on one group, rank 0's times are reported, and the optimizer is judged against
``ddp`` (plain SGD sends nothing).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from gravac import GravacOptimizer
from gravac.ddp import GravacHookState, gravac_hook
from gravac_lab.bench.common import environment, format_table, interleaved_medians, json_row
from gravac_lab.compare import workloads

__all__ = [
    "DEFAULT_STEPS",
    "DEFAULT_WARMUP",
    "FRONTS",
    "StepResult",
    "bench_step",
    "format_step_table",
]

#: the timed steps of each front (medians are reported)
DEFAULT_STEPS = 20
#: untimed steps of each front first (layouts, the first window, allocator growth)
DEFAULT_WARMUP = 5
#: samples per step
BATCH_SIZE = 32
#: the static CF of gravac's fronts unless ``--cf`` (issue 37's target is stated at CF 100)
DEFAULT_CF = 100.0
#: SGD's momentum, as ``gravac compare`` trains
MOMENTUM = 0.9
#: the fronts, each gravac one after its plain counterpart
FRONTS = ("sgd", "optimizer", "ddp", "hook")


def baseline(front: str, workers: int) -> str:
    """``front``'s plain counterpart: DDP for the hook; for the optimizer plain SGD, or DDP
    where several workers communicate (plain SGD does not); a plain front's is its own."""
    if front == "hook" or (front == "optimizer" and workers > 1):
        return "ddp"
    return "sgd" if front == "optimizer" else front


#: what gravac sends: a static CF, or the defaults (the adaptive search)
POLICIES = ("fixed", "default")


@dataclass(frozen=True)
class StepResult:
    """One front of ``gravac bench step`` (seconds are medians of the timed steps).

    ``ratio = seconds / baseline_seconds`` against the front's plain counterpart (1.0 for the
    plain fronts themselves), ``extra = ratio - 1``.
    """

    front: str
    workload: str
    device: str
    policy: str
    cf: float
    steps: int
    workers: int
    seconds: float
    baseline: str
    baseline_seconds: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline_seconds

    @property
    def extra(self) -> float:
        return self.ratio - 1.0

    def to_json(self) -> dict[str, Any]:
        return {**json_row(self), "ratio": self.ratio, "extra": self.extra}


def _options(policy: str, cf: float) -> dict[str, Any]:
    if policy == "fixed":
        return {"compressor": "topk", "policy": "fixed", "policy_options": {"cf": cf}}
    return {"compressor": "topk"}


class _Front:
    """One model copy and what steps it."""

    def __init__(
        self, front: str, work: workloads.Workload, device: torch.device, options: dict[str, Any]
    ) -> None:
        torch.manual_seed(0)
        model = work.model().to(device)
        self.module: nn.Module = model
        if front in ("ddp", "hook"):
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
            if front == "hook":
                ddp.register_comm_hook(
                    GravacHookState(**options, batch_size=BATCH_SIZE), gravac_hook
                )
            self.module = ddp
        sgd = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=MOMENTUM)
        self.optimizer: Any = sgd
        if front == "optimizer":
            self.optimizer = GravacOptimizer(sgd, **options, batch_size=BATCH_SIZE)
        self.loss: Callable[[Tensor, Tensor], Tensor] = work.loss

    def step(self, x: Tensor, y: Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.module(x), y).backward()
        self.optimizer.step()

    def close(self) -> None:
        if isinstance(self.optimizer, GravacOptimizer):
            self.optimizer.close()


def _batches(
    work: workloads.Workload, count: int, device: torch.device, *, seed: int
) -> list[tuple[Tensor, Tensor]]:
    train_x, train_y, _, _ = work.data()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        idx = torch.randint(0, len(train_y), (BATCH_SIZE,), generator=gen)
        out.append((train_x[idx].to(device), train_y[idx].to(device)))
    return out


def _cases(
    fronts: Sequence[_Front], batches: Sequence[tuple[Tensor, Tensor]]
) -> list[Callable[[], Callable[[], object]]]:
    """For :func:`gravac_lab.bench.common.interleaved_medians`: each front's step on the next
    of ``batches`` (each front goes through them in order)."""

    def case(front: _Front) -> Callable[[], Callable[[], object]]:
        pending = iter(batches)

        def prepare() -> Callable[[], object]:
            x, y = next(pending)
            return lambda: front.step(x, y)

        return prepare

    return [case(f) for f in fronts]


@dataclass(frozen=True)
class _Job:
    """What each process of :func:`bench_step` measures (picklable, for spawned workers)."""

    workload: str
    steps: int
    warmup: int
    options: dict[str, Any]
    device: str
    workers: int
    threads: int


#: the file rank 0 of spawned workers writes its medians to, in the run's temporary folder
_RESULT = "medians.json"


def _measure(rank: int, job: _Job, folder: str) -> list[float]:
    """This rank's median step of each front, on the group of ``job.workers`` ranks whose
    rendezvous file is in ``folder``; rank 0 of spawned workers also writes them there."""
    torch.set_num_threads(job.threads)
    store = os.path.join(folder, "rendezvous")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=job.workers
    )
    work, dev = workloads.get(job.workload), torch.device(job.device)
    fronts = [_Front(f, work, dev, job.options) for f in FRONTS]
    try:
        cases = _cases(fronts, _batches(work, job.warmup + job.steps, dev, seed=rank))
        for _ in range(job.warmup - 1):  # interleaved_medians takes one untimed step itself
            for prepare in cases:
                prepare()()
        seconds = interleaved_medians(cases, repeats=job.steps, device=dev)
    finally:
        for f in fronts:
            f.close()
        dist.destroy_process_group()
    if rank == 0 and job.workers > 1:
        Path(folder, _RESULT).write_text(json.dumps(seconds))
    return seconds


def bench_step(
    *,
    workload: str = "vgg-digits",
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    policy: str = "fixed",
    cf: float = DEFAULT_CF,
    device: str | torch.device = "cpu",
    workers: int = 1,
) -> list[StepResult]:
    """Time a step of every front of :data:`FRONTS` (see the module docstring).

    Runs on a gloo group of its own (a rendezvous file in a temporary folder): in this process
    at ``workers=1``; else ``workers`` spawned processes sharing ``device``, whose times are
    rank 0's. Refuses to run inside an initialised process group, whose world it would not be.

    Raises:
        ValueError: an unknown workload or policy, or ``steps`` / ``warmup`` / ``workers`` out
            of range.
        RuntimeError: a process group is already initialised.
    """
    workloads.get(workload)  # an unknown name raises here, before any process starts
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if min(steps, warmup, workers) < 1:
        raise ValueError(
            f"steps, warmup and workers must be >= 1, got {steps}, {warmup} and {workers}"
        )
    if dist.is_initialized():
        raise RuntimeError("gravac bench step runs its own one-process group; one is initialised")
    dev = torch.device(device)
    threads = max(1, torch.get_num_threads() // workers)  # this process's, shared out
    job = _Job(workload, steps, warmup, _options(policy, cf), str(dev), workers, threads)
    with tempfile.TemporaryDirectory(prefix="gravac-bench-step-") as folder:
        if workers == 1:
            seconds = _measure(0, job, folder)
        else:
            mp.spawn(_measure, args=(job, folder), nprocs=workers)
            seconds = json.loads(Path(folder, _RESULT).read_text())
    by_front = dict(zip(FRONTS, seconds, strict=True))
    return [
        StepResult(
            front=f,
            workload=workload,
            device=str(dev),
            policy=policy,
            cf=cf,
            steps=steps,
            workers=workers,
            seconds=by_front[f],
            baseline=baseline(f, workers),
            baseline_seconds=by_front[baseline(f, workers)],
        )
        for f in FRONTS
    ]


def _processes(workers: int) -> str:
    return "one process" if workers == 1 else f"{workers} processes (rank 0's times) sharing"


def format_step_table(results: Sequence[StepResult]) -> str:
    """The report: a header, then one row per front."""
    r0 = results[0]
    sends = f"Top-k at a static CF of {r0.cf:g}" if r0.policy == "fixed" else "the default search"
    header = (
        f"gravac bench step: {r0.workload}, batch {BATCH_SIZE}, {_processes(r0.workers)} on "
        f"{environment(torch.device(r0.device))}; gravac sends {sends}; median of {r0.steps} "
        "steps each, the fronts in turn\n"
        f"  ratio = a front's step / its plain counterpart's (optimizer: "
        f"{baseline('optimizer', r0.workers)}, hook: ddp); "
        "extra = ratio - 1, gravac's share of a plain step (target <= 0.10)\n"
    )
    rows = [
        [
            r.front,
            f"{r.seconds * 1e3:.2f}",
            r.baseline,
            f"{r.ratio:.3f}",
            f"{r.extra:+.3f}",
        ]
        for r in results
    ]
    return header + format_table(["front", "step ms", "against", "ratio", "extra"], rows)
