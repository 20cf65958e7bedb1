"""What both benchmarks share: inputs, the timing loop, compressor instances, table layout.

All times are medians over ``repeats`` after one untimed warm-up, by :func:`time.perf_counter`,
with the garbage collector paused (as :mod:`timeit` does); see :func:`interleaved_medians`. The
synthetic gradients (:func:`synthetic_gradients`) share a heavy-tailed component across workers
plus per-worker noise; the flat gradient is a bucket of a plausible model (:func:`model_layout`)
passed to every compressor as :attr:`Round.layout`.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from gravac import compressors
from gravac.compressors import Compressor, Round
from gravac.compressors.base import local_stats
from gravac.simulation import reduce_stats

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "Instances",
    "agreed_round",
    "bench_each",
    "describe_size",
    "environment",
    "format_table",
    "gbps",
    "interleaved_medians",
    "json_row",
    "model_layout",
    "nmse",
    "parse_size",
    "synthetic_gradients",
]

#: Multipliers of the ``--size`` suffixes (binary: ``4K`` is 4096 elements, ``16M`` 2^24).
SIZE_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)

#: Bytes per element of the benchmarked gradients (float32: docs/design.md section 1's reference).
ELEMENT_BYTES = 4
#: Throughputs are reported in GB/s of 1e9 bytes.
BYTES_PER_GB = 1e9

# Defaults of the command-line options both benchmarks take.
DEFAULT_REPEATS = 5
DEFAULT_SIZE = "16M"
DEFAULT_SEED = 0

#: The step every benchmark round claims to be: far past any sparsity warm-up schedule (DGC's
#: 75% ... 99.9%), so compressors run at their steady-state CF. Seeds derive from it.
BENCH_STEP = 10_000
#: Bucket key of the benchmarked gradient.
BENCH_KEY = 0

# The synthetic gradient of worker i at coordinate j is ``sigma_j * (z_j + r * eps_ij)``:
#: std of ``log sigma_j``: per-coordinate scales drawn log-normal(0, 1), shared by all workers,
#: give the heavy tails of real gradients (kurtosis 3 e^4, about 160, 130-150 measured; the top
#: 1% of coordinates hold about half of the squared norm).
LOG_SCALE_STD = 1.0
#: ``r``, per-worker minibatch noise relative to the shared signal ``z`` (both standard normal):
#: noise of the order of the true gradient, as in mid-training SGD (two workers' gradients have
#: correlation 1 / (1 + r^2) = 0.5).
NOISE_RATIO = 1.0
#: The factor ``subnormal`` scales a gradient's tail by: values of its size times 2^-130 lie
#: below 2^-126, in float32's subnormal range, where a block of zero gradients' residual ends up
#: under error feedback (a rotation or product over them runs an x86 core's slow path).
SUBNORMAL_SCALE = 2.0**-130

#: The synthetic model is a stack of feed-forward weights that alternate (w, e*w) and (e*w, w)
#: with this expansion ratio e, as in a transformer's MLP blocks.
MLP_EXPANSION = 4
#: The width w is the largest power of two that still gives at least this many weight matrices,
#: so that per-matrix compressors (PowerSGD) see many matrices, as in a real bucket.
MIN_MATRICES = 8

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def parse_size(text: str, *, option: str = "--size") -> int:
    """Element count from ``text``: a positive integer with an optional K, M or G suffix.

    Suffixes are binary and case-insensitive: ``512K`` is 524288, ``16M`` is 16777216, ``1G`` is
    2^30 elements.

    Raises:
        ValueError: ``text`` is not of that form or is zero; the message names ``option``.
    """
    match = _SIZE_RE.match(str(text))
    if match is None or int(match.group(1)) == 0:
        raise ValueError(
            f"{option} must be a positive element count such as 4096, 512K, 16M or 1G "
            f"(binary K/M/G suffixes), got {text!r}"
        )
    return int(match.group(1)) * SIZE_SUFFIXES[match.group(2).upper()]


def model_layout(size: int) -> tuple[torch.Size, ...]:
    """Shapes of a plausible model whose gradients fill a flat bucket of ``size`` elements.

    Feed-forward weights alternating ``(w, 4w)`` and ``(4w, w)`` (see :data:`MLP_EXPANSION`,
    :data:`MIN_MATRICES`), then one ``(rows, w)`` matrix and one 1-D tensor (biases) for the
    remainder; the numels add up to ``size`` exactly.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    width = 1
    while MLP_EXPANSION * (2 * width) ** 2 * MIN_MATRICES <= size:
        width *= 2
    wide = width * MLP_EXPANSION
    block = width * wide
    shapes: list[torch.Size] = []
    remaining = size
    while remaining >= block:
        shapes.append(torch.Size((width, wide) if len(shapes) % 2 == 0 else (wide, width)))
        remaining -= block
    if remaining >= width:
        shapes.append(torch.Size((remaining // width, width)))
        remaining %= width
    if remaining:
        shapes.append(torch.Size((remaining,)))
    return tuple(shapes)


def synthetic_gradients(
    size: int,
    workers: int,
    *,
    seed: int = DEFAULT_SEED,
    device: str | torch.device = "cpu",
    subnormal: float = 0.0,
) -> list[Tensor]:
    """``workers`` flat float32 gradients ``g_i = sigma * (z + r * eps_i)`` of ``size`` elements.

    ``sigma`` is log-normal(0, :data:`LOG_SCALE_STD`) per coordinate and ``z`` standard normal,
    both shared by all workers (the true gradient is ``sigma * z``); ``eps_i`` is each worker's
    standard normal noise, scaled by ``r`` = :data:`NOISE_RATIO`. Drawn on the CPU from a
    generator seeded with ``seed``, so the values do not depend on ``device``. The last
    ``subnormal`` fraction of the elements is scaled by :data:`SUBNORMAL_SCALE` (most become
    subnormal).
    """
    if size < 1 or workers < 1:
        raise ValueError(f"size and workers must be >= 1, got size={size}, workers={workers}")
    if not 0.0 <= subnormal <= 1.0:
        raise ValueError(f"subnormal must be a fraction in [0, 1], got {subnormal}")
    tail = round(size * subnormal)
    gen = torch.Generator().manual_seed(seed)
    sigma = torch.randn(size, generator=gen).mul_(LOG_SCALE_STD).exp_()
    shared = torch.randn(size, generator=gen)
    grads = []
    for _ in range(workers):
        noise = torch.randn(size, generator=gen).mul_(NOISE_RATIO).add_(shared).mul_(sigma)
        noise[size - tail :].mul_(SUBNORMAL_SCALE)
        grads.append(noise.to(device))
    return grads


def nmse(estimate: Tensor, truth: Tensor) -> float:
    """``||estimate - truth||^2 / ||truth||^2`` in float64 (NaN for a zero ``truth``)."""
    t = truth.detach().reshape(-1).double()
    err = estimate.detach().reshape(-1).double() - t
    denom = float(t.square().sum())
    return float(err.square().sum()) / denom if denom > 0.0 else math.nan


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    cases: Sequence[Callable[[], Callable[[], object]]], *, repeats: int, device: torch.device
) -> list[float]:
    """Median seconds of each case, the cases run in turn within each repeat.

    A case is a *prepare* function (untimed: builds a fresh compressor and the like) returning
    the call to time. Every case is prepared and called once untimed first (warm-up). The result
    of a call is freed after the clock stops.
    """
    for prepare in cases:
        prepare()()
    times: list[list[float]] = [[] for _ in cases]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for prepare, out in zip(cases, times, strict=True):
                call = prepare()
                _sync(device)
                start = time.perf_counter()
                result = call()
                _sync(device)
                out.append(time.perf_counter() - start)
                del result
    finally:
        if gc_was_enabled:
            gc.enable()
    return [statistics.median(t) for t in times]


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (:data:`BYTES_PER_GB`) of ``nbytes`` in ``seconds`` (inf for 0 s)."""
    return nbytes / seconds / BYTES_PER_GB if seconds > 0.0 else math.inf


# ----------------------------------------------------------------------------------------------
# Compressor instances
# ----------------------------------------------------------------------------------------------


class Instances:
    """Hands out compressors of one name, each in the state the benchmark round left.

    After :meth:`prime`, a stateless compressor is the primed instance itself; a stateful one
    (non-empty ``state_dict``) is a fresh instance loaded with the snapshot each time.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.primed = compressors.create(name)
        self.snapshot: dict[str, Any] = {}

    def prime(self, run: Callable[[Compressor], T]) -> T:
        """Run ``run`` on the primed instance, then snapshot its state."""
        out = run(self.primed)
        self.snapshot = copy.deepcopy(self.primed.state_dict())
        return out

    @property
    def stateful(self) -> bool:
        """Whether the compressor kept state after priming."""
        return bool(self.snapshot)

    def get(self) -> Compressor:
        """A compressor in the snapshotted state."""
        if not self.stateful:
            return self.primed
        fresh = compressors.create(self.name)
        fresh.load_state_dict(copy.deepcopy(self.snapshot))
        return fresh


def bench_each(names: Iterable[str], bench: Callable[[str], T], *, failure: str) -> list[T]:
    """``bench(name)`` for each of ``names``, in order.

    Raises:
        RuntimeError: ``bench`` failed; the message is ``failure`` with ``{name}`` filled in,
            then the cause's (which is chained).
    """
    results = []
    for name in names:
        print(f"gravac bench: {name} ...", file=sys.stderr, flush=True)  # long runs show progress
        try:
            results.append(bench(name))
        except Exception as exc:
            raise RuntimeError(f"{failure.format(name=name)}: {exc}") from exc
    return results


def agreed_round(
    c: Compressor, xs: Sequence[Tensor], cf: float, layout: tuple[torch.Size, ...] | None
) -> Round:
    """The round of ``len(xs)`` workers with their local stats reduced, as every rank sees it."""
    probe = Round(step=BENCH_STEP, key=BENCH_KEY, world_size=len(xs), layout=layout)
    agreed = reduce_stats(c, [local_stats(c, x, cf, probe) for x in xs])
    return dataclasses.replace(probe, agreed=agreed)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def json_row(row: DataclassInstance) -> dict[str, Any]:
    """The fields of a result ``row``, JSON-ready: non-finite floats become ``None``."""
    return {k: _finite_or_none(v) for k, v in dataclasses.asdict(row).items()}


def _finite_or_none(v: object) -> object:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Fixed-width table: first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def describe_size(size: int) -> str:
    """``size`` float32 elements in words, with their MiB, for a table's header."""
    return f"{size:,} float32 elements ({size * ELEMENT_BYTES / 2**20:.1f} MiB)"


def environment(device: torch.device) -> str:
    """The device, torch version and intra-op threads, for a table's header."""
    threads = torch.get_num_threads()
    plural = "" if threads == 1 else "s"
    return f"device {device}, torch {torch.__version__}, {threads} thread{plural}"
