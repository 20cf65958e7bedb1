"""``gravac bench memory``: the extra peak memory of a training step, per compressor.

For each compressor, in a fresh process (so that no allocator state of another compressor
remains): a stack of ``Linear(width, width, bias=False)`` layers holding about ``--params``
float32 parameters is trained for a few steps with plain SGD, then with :class:`GravacOptimizer`
around the same SGD (single worker, no process group: the compression, error feedback and gain
terms all run; the collectives are the identity), under one of :data:`POLICIES`. The gradients
are zeroed in place between steps, or set to ``None`` (``set_to_none``, ``zero_grad()``'s
default: each backward then makes fresh gradients). The peak resident set size (Linux ``VmHWM``,
reset through ``/proc/self/clear_refs``) of ``backward()`` and ``step()`` together, above the
resident size of plain SGD's steady state and less plain SGD's own peak above it (activations,
autograd's temporaries), is the compressor's extra peak memory, in MiB and as a multiple of the
gradient's bytes (issue 9's target: at most 2, the residual plus one work buffer). Two figures:
over the first steps (the switch from plain SGD: gradients moved into bucket buffers, residuals
and reused buffers made) and over the steps after them (the steady state); and the resident
memory gravac holds between steps (the residuals, the search's state). ``front="hook"``
measures the DDP comm hook instead: a one-process gloo group, plain DDP first, then a new
``DistributedDataParallel`` of the same model with the hook (DDP takes a hook only before its
first backward), against plain DDP's steady state and peak.

The children run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so that every large
block is its own mapping, returned on free: resident memory then follows the live bytes (with
glibc's default adaptive threshold, freed gradient-sized blocks stay resident in the heap).
"""

from __future__ import annotations

import gc
import itertools
import math
import multiprocessing
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gravac import compressors
from gravac.ddp import GravacHookState, gravac_hook
from gravac.optimizer import GravacOptimizer
from gravac_lab.bench.common import ELEMENT_BYTES, bench_each, format_table, json_row

__all__ = [
    "DEFAULT_PARAMS",
    "DEFAULT_STEPS",
    "FIXED_CF",
    "FRONTS",
    "POLICIES",
    "MemoryResult",
    "bench_memory",
    "format_memory_table",
    "memory_names",
    "peak_rss_above",
]

#: Parameters of the benchmark model, as in issue 9's measurement (50M float32, 191 MiB).
DEFAULT_PARAMS = 50 * 2**20
#: Steps of plain SGD, of gravac's first window and of its steady-state window.
DEFAULT_STEPS = 3
#: What is measured: :class:`GravacOptimizer` around plain SGD, or the DDP comm hook
#: (:mod:`gravac.ddp`) on a one-process gloo group against plain DDP.
FRONTS = ("optimizer", "hook")
#: Width of the square layers: 4M parameters each, so 50M is twelve layers.
WIDTH = 2048
#: Samples per step: activations of 8 x 2048 floats per layer are negligible next to weights.
BATCH = 8
#: The CF every compressor is asked for (GraVAC's theta_min, docs/design.md section 9.1).
CF = 10.0
#: What GravacOptimizer runs: Algorithm 1 from ``CF`` with a candidate at every step and
#: ``epsilon`` 0, so that every step sends a compressed payload and a candidate (the default);
#: a static CF (``cf``); or :class:`gravac.GravacConfig`'s defaults (the adaptive search: the
#: exponential ladder judged by shadow), as a user who names only the compressor runs it, but
#: on a counter clock (its decisions repeat from run to run).
POLICIES = ("candidate", "fixed", "default")
#: The static CF of ``policy="fixed"`` unless another is given.
FIXED_CF = 100.0
_KIB = 1024
_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
_MIB = 2**20
_CLEAR_PEAK = "5"  # /proc/self/clear_refs: reset the peak resident set size (Linux >= 4.0)
#: glibc's mmap threshold in the children: blocks above it are mapped alone and unmapped on free.
_MMAP_THRESHOLD = str(128 * _KIB)


@dataclass(frozen=True)
class MemoryResult:
    """One row of ``gravac bench memory`` (bytes; ``ratio`` in gradients)."""

    name: str
    params: int
    width: int  # the layers are width x width
    front: str  # one of FRONTS
    policy: str  # one of POLICIES
    cf: float  # the static CF of policy "fixed", else CF (the lowest sent)
    set_to_none: bool  # gradients set to None between steps, not zeroed in place
    gradient_bytes: int
    sgd_peak_bytes: int  # plain SGD's (or plain DDP's) peak above its steady state
    first_bytes: int  # gravac's peak over its first steps, above SGD's steady state and peak
    steady_bytes: int  # the same over the steps after them
    first_ratio: float  # first_bytes / gradient_bytes
    ratio: float  # steady_bytes / gradient_bytes
    held_bytes: int  # what gravac keeps resident between steps, above SGD's steady state
    held_ratio: float  # held_bytes / gradient_bytes

    def to_json(self) -> dict[str, Any]:
        return json_row(self)


def _status_kib(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} field")
    return int(match.group(1))


def peak_rss_above(work: Any, *args: Any) -> int:
    """Bytes by which the resident set size peaked above its level before ``work(*args)``.

    Raises:
        RuntimeError: not on Linux (no ``/proc/self/clear_refs``).
    """
    clear = Path("/proc/self/clear_refs")
    if not clear.exists():
        raise RuntimeError("gravac bench memory needs Linux (/proc/self/clear_refs)")
    before = _status_kib("VmRSS")
    clear.write_text(_CLEAR_PEAK)
    work(*args)
    return max(0, _status_kib("VmHWM") - before) * _KIB


def _model(params: int, width: int) -> nn.Module:
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def _steps(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int, set_to_none: bool
) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        model(x).square().mean().backward()
        opt.step()


def _options(policy: str, cf: float) -> dict[str, Any]:
    """The :class:`gravac.GravacConfig` fields of ``policy`` (:data:`POLICIES`)."""
    if policy == "fixed":
        return {"policy": "fixed", "policy_options": {"cf": cf}}
    if policy == "default":  # the CFs it sends, and so what it holds, follow its timings
        return {"clock": _counter_clock()}
    return {
        "theta_min": CF,
        "warmup_steps": 0,
        "window": 1,
        "epsilon": 0.0,  # every gain is enough: compressed sends, never a dense fallback
        "search": "paper",  # a candidate compressed at every step
    }


def _counter_clock() -> Callable[[], float]:
    """A clock one second later at every call: the search's timing-based decisions, and so the
    CFs it sends at each step, are the same in every run (on a loaded machine or not)."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


@dataclass(frozen=True)
class _Setting:
    """What one measurement runs (the arguments of :func:`bench_memory`, but the names)."""

    params: int
    steps: int
    threads: int
    width: int
    front: str
    policy: str
    cf: float
    set_to_none: bool


def _measure(name: str, setting: _Setting, folder: str) -> MemoryResult:
    """The row of ``name``, measured in this (fresh) process: through the optimizer, or
    through the DDP hook on a one-process gloo group (against plain DDP) whose rendezvous file
    goes in ``folder``."""
    params, steps, width, front = setting.params, setting.steps, setting.width, setting.front
    threads, set_to_none = setting.threads, setting.set_to_none
    torch.set_num_threads(threads)
    model = _model(params, width)
    x = torch.randn(BATCH, width)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    if front == "hook":  # the group's rendezvous file, in the caller's temporary folder
        store = Path(folder) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    # plain SGD (or DDP) until its gradients and buckets are allocated: the steady state
    net = DistributedDataParallel(model) if front == "hook" else model
    _steps(net, sgd, x, steps, set_to_none)
    sgd_peak = peak_rss_above(_steps, net, sgd, x, steps, set_to_none)
    base = _status_kib("VmRSS") * _KIB
    options = {"compressor": name, **_options(setting.policy, setting.cf)}
    opt: torch.optim.Optimizer = sgd
    if front == "hook":  # a new DDP (a hook goes in before the first backward) for the old
        del net
        gc.collect()  # DDP sits in a reference cycle: free the old one's buckets now
        net = DistributedDataParallel(model)
        net.register_comm_hook(GravacHookState(**options), gravac_hook)
    else:
        opt = GravacOptimizer(sgd, dense_bytes=0, **options)
    first = peak_rss_above(_steps, net, opt, x, steps, set_to_none)
    held = _status_kib("VmRSS") * _KIB - base  # what gravac keeps between steps
    steady = held + peak_rss_above(_steps, net, opt, x, steps, set_to_none)
    n = sum(p.numel() for p in model.parameters())
    grad_bytes = n * ELEMENT_BYTES
    first, steady = max(0, first - sgd_peak), max(0, steady - sgd_peak)
    held = max(0, held)
    return MemoryResult(
        name,
        n,
        width,
        front,
        setting.policy,
        setting.cf if setting.policy == "fixed" else CF,
        set_to_none,
        grad_bytes,
        sgd_peak,
        first,
        steady,
        first / grad_bytes,
        steady / grad_bytes,
        held,
        held / grad_bytes,
    )


def memory_names() -> list[str]:
    """Every registered compressor, in name order."""
    return list(compressors.names())


def bench_memory(
    *,
    names: Sequence[str] | None = None,
    params: int = DEFAULT_PARAMS,
    steps: int = DEFAULT_STEPS,
    threads: int | None = None,
    width: int = WIDTH,
    front: str = "optimizer",
    policy: str = "candidate",
    cf: float = FIXED_CF,
    set_to_none: bool = False,
) -> list[MemoryResult]:
    """Measure each compressor (``None``: every registered one) in its own fresh process, on
    layers of ``width x width`` parameters, through ``front`` (:data:`FRONTS`), under
    ``policy`` (:data:`POLICIES`; ``cf``: the static CF of ``"fixed"``), the gradients set to
    ``None`` between steps (``set_to_none``) or zeroed in place.

    Raises:
        ValueError: ``front`` is not one of :data:`FRONTS`, or ``policy`` of :data:`POLICIES`.
    """
    if front not in FRONTS:
        raise ValueError(f"front must be one of {list(FRONTS)}, got {front!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    ctx = multiprocessing.get_context("spawn")
    t = threads if threads is not None else torch.get_num_threads()
    setting = _Setting(params, steps, t, width, front, policy, cf, set_to_none)

    def one(name: str) -> MemoryResult:
        before = os.environ.get(_MMAP_ENV)
        os.environ[_MMAP_ENV] = _MMAP_THRESHOLD  # read by the child's allocator at its start
        try:
            with (
                tempfile.TemporaryDirectory(prefix="gravac-bench-memory-") as folder,
                ctx.Pool(1) as pool,
            ):
                return pool.apply(_measure, (name, setting, folder))
        finally:
            if before is None:
                del os.environ[_MMAP_ENV]
            else:
                os.environ[_MMAP_ENV] = before

    return bench_each(names or memory_names(), one, failure="measuring {name} failed")


def format_memory_table(results: Sequence[MemoryResult]) -> str:
    """The human-readable report of ``gravac bench memory``."""
    if not results:
        return "no compressor measured"
    r0 = results[0]
    layers = max(1, round(r0.params / (r0.width * r0.width)))
    plain = "plain DDP" if r0.front == "hook" else "plain SGD"
    how = "the DDP comm hook" if r0.front == "hook" else "GravacOptimizer"
    zeroed = "set to None" if r0.set_to_none else "zeroed in place"
    header = [
        f"gravac bench memory: {r0.params:,} float32 parameters ({layers} x Linear({r0.width}, "
        f"{r0.width})), gradient {r0.gradient_bytes / _MIB:.0f} MiB, {_policy_text(r0)}, one "
        f"worker, through {how}, gradients {zeroed} between steps",
        f"  extra = peak resident memory of backward() + step() above {plain}'s steady state,"
        f" less {plain}'s own peak, over the first steps and over the steps after them"
        " (steady); ratio = extra / gradient bytes (target <= 2); held = resident memory"
        f" between steps (after the first steps) above {plain}'s steady state",
        f"  {plain}'s own peak: {r0.sgd_peak_bytes / _MIB:.0f} MiB",
    ]
    headers = [
        "compressor",
        "first MiB",
        "first ratio",
        "steady MiB",
        "steady ratio",
        "held ratio",
    ]
    rows = [
        [
            r.name,
            f"{r.first_bytes / _MIB:.0f}",
            _ratio(r.first_ratio),
            f"{r.steady_bytes / _MIB:.0f}",
            _ratio(r.ratio),
            _ratio(r.held_ratio),
        ]
        for r in results
    ]
    return "\n".join([*header, "", format_table(headers, rows)])


def _policy_text(row: MemoryResult) -> str:
    """What ``row``'s optimizer sent, in words."""
    if row.policy == "fixed":
        return f"static CF {row.cf:g}"
    if row.policy == "default":
        return "the default adaptive search"
    return f"CF {row.cf:g} with a candidate from the first step"


def _ratio(ratio: float) -> str:
    return f"{ratio:.2f}" if math.isfinite(ratio) else "-"
