"""Compressor benchmarks: ``gravac bench compressors`` and ``gravac bench multilevel``.

``compressors`` measures, for every registered compressor (or those named), on one process:

* **compress** throughput: GB/s (1e9 bytes) of float32 input for ``local_stats`` + ``compress``
  of one worker's gradient. The cross-rank reduction of the local stats is communication and is
  not timed: ``compress`` gets the values agreed among the N simulated workers, computed first;
* **copy** throughput: ``dst.copy_(src)`` of the same gradient into a preallocated buffer, timed
  in the same loop as compress (one copy, then one compress, per repeat), so that both see the
  same machine noise; ``ratio_to_copy = input_gbps / copy_gbps`` is the cost of compression in
  units of the cheapest possible pass over the gradient;
* **decompress** throughput: GB/s of the dense float32 result for :meth:`Compressor.combine` of
  the N workers' payloads, which is what a rank runs after the collective (for all-reduce
  compressors it includes the elementwise payload sum that the all-reduce itself would compute);
* **NMSE** of the N-worker mean estimate of one round, ``||mean_hat - mean||^2 / ||mean||^2``,
  from :func:`gravac.simulation.simulate` with a fresh compressor and no error feedback, and the
  achieved CF and wire bytes per worker of that round.

All times are medians over ``repeats`` after one untimed warm-up, by :func:`time.perf_counter`,
with the garbage collector paused (as :mod:`timeit` does). The synthetic gradients
(:func:`synthetic_gradients`) share a heavy-tailed component across workers plus per-worker
noise; the flat gradient is a bucket of a plausible model (:func:`model_layout`) passed to every
compressor as :attr:`Round.layout`.

Stateful compressors (PowerSGD's warm start, updated in ``combine``) are primed by the NMSE round;
their :meth:`Compressor.state_dict` is then snapshotted, and each timed call runs on a fresh
instance loaded with that snapshot, so that every repeat starts from the same state. Stateless
compressors (empty ``state_dict``) reuse the primed instance.

``multilevel`` times, for each compressor with ``supports_multilevel``, compressing at ``cf1``
then recompressing the result to ``cf2`` (DESIGN.md section 4) against compressing the input at
``cf1`` and at ``cf2`` directly; GraVAC (Tyagi and Swany, IEEE CLOUD 2023) reports 1.1x-1.83x
saving.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from gravac import compressors
from gravac.compressors import Compressor, Context, Payload, Round, check_cf, wire_bytes
from gravac.compressors.base import StatsOp
from gravac.simulation import SimulationResult, reduce_stats, simulate

__all__ = [
    "CompressorResult",
    "MultilevelResult",
    "add_parser",
    "bench_compressor",
    "bench_compressors",
    "bench_multilevel",
    "format_compressor_table",
    "format_multilevel_table",
    "model_layout",
    "nmse",
    "parse_size",
    "synthetic_gradients",
]

#: Multipliers of the ``--size`` suffixes (binary: ``4K`` is 4096 elements, ``16M`` 2^24).
SIZE_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)

#: Bytes per element of the benchmarked gradients (float32, the CF reference of DESIGN.md 1).
ELEMENT_BYTES = 4
#: Throughputs are reported in GB/s of 1e9 bytes.
BYTES_PER_GB = 1e9

# Defaults of the command-line options.
DEFAULT_CF = 100.0
DEFAULT_WORKERS = 4
DEFAULT_REPEATS = 5
DEFAULT_SIZE = "16M"
DEFAULT_SEED = 0
#: GraVAC's default theta_min and theta_max (DESIGN.md section 5).
DEFAULT_CF1 = 10.0
DEFAULT_CF2 = 1000.0

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
    size: int, workers: int, *, seed: int = DEFAULT_SEED, device: str | torch.device = "cpu"
) -> list[Tensor]:
    """``workers`` flat float32 gradients ``g_i = sigma * (z + r * eps_i)`` of ``size`` elements.

    ``sigma`` is log-normal(0, :data:`LOG_SCALE_STD`) per coordinate and ``z`` standard normal,
    both shared by all workers (the true gradient is ``sigma * z``); ``eps_i`` is each worker's
    standard normal noise, scaled by ``r`` = :data:`NOISE_RATIO`. Drawn on the CPU from a
    generator seeded with ``seed``, so the values do not depend on ``device``.
    """
    if size < 1 or workers < 1:
        raise ValueError(f"size and workers must be >= 1, got size={size}, workers={workers}")
    gen = torch.Generator().manual_seed(seed)
    sigma = torch.randn(size, generator=gen).mul_(LOG_SCALE_STD).exp_()
    shared = torch.randn(size, generator=gen)
    grads = []
    for _ in range(workers):
        noise = torch.randn(size, generator=gen).mul_(NOISE_RATIO).add_(shared).mul_(sigma)
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


def _interleaved_medians(
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


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / BYTES_PER_GB if seconds > 0.0 else math.inf


# ----------------------------------------------------------------------------------------------
# Compressor instances
# ----------------------------------------------------------------------------------------------


def _with_layout(inner: Compressor, layout: tuple[torch.Size, ...]) -> Compressor:
    """``inner`` with ``layout`` put into every :class:`Round` it is given.

    :func:`gravac.simulation.simulate` builds its rounds without a layout; this adapter lets the
    NMSE round use the same bucket layout as the timed calls.
    """

    class _LayoutAdapter(Compressor):
        name: ClassVar[str] = inner.name
        stats_op: ClassVar[StatsOp] = inner.stats_op
        collective = inner.collective
        supports_multilevel = inner.supports_multilevel

        def local_stats(self, x: Tensor, cf: float, rnd: Round) -> Tensor | None:
            return inner.local_stats(x, cf, dataclasses.replace(rnd, layout=layout))

        def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[Payload, Context]:
            return inner.compress(x, cf, dataclasses.replace(rnd, layout=layout))

        def decompress(self, payload: Payload, ctx: Context) -> Tensor:
            return inner.decompress(payload, ctx)

        def combine(self, payloads: Sequence[Payload], ctx: Context) -> Tensor:
            return inner.combine(payloads, ctx)

    return _LayoutAdapter()


class _Instances:
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


def _agreed_round(
    c: Compressor, xs: Sequence[Tensor], cf: float, layout: tuple[torch.Size, ...] | None
) -> Round:
    """The round of ``len(xs)`` workers with their local stats reduced, as every rank sees it."""
    probe = Round(step=BENCH_STEP, key=BENCH_KEY, world_size=len(xs), layout=layout)
    agreed = reduce_stats(c, [c.local_stats(x, cf, probe) for x in xs])
    return dataclasses.replace(probe, agreed=agreed)


# ----------------------------------------------------------------------------------------------
# gravac bench compressors
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressorResult:
    """One row of ``gravac bench compressors`` (times in seconds, throughputs in GB/s)."""

    name: str
    collective: str
    stateful: bool
    size: int
    workers: int
    repeats: int
    cf_requested: float
    achieved_cf: float
    #: bytes one worker's payload puts on the wire (the largest over workers)
    wire_bytes: int
    nmse: float
    compress_s: float
    copy_s: float
    decompress_s: float
    input_gbps: float
    copy_gbps: float
    ratio_to_copy: float
    decompress_gbps: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""
        return {k: _finite_or_none(v) for k, v in dataclasses.asdict(self).items()}


def _finite_or_none(v: object) -> object:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def bench_compressor(
    name: str,
    grads: Sequence[Tensor],
    *,
    cf: float = DEFAULT_CF,
    repeats: int = DEFAULT_REPEATS,
    layout: tuple[torch.Size, ...] | None = None,
) -> CompressorResult:
    """Benchmark compressor ``name`` on the flat per-worker ``grads`` (see the module docstring).

    Args:
        name: a registered compressor.
        grads: one flat float32 gradient per worker; worker 0's is the one timed.
        cf: requested compression factor.
        repeats: timed repeats per measurement (medians are reported).
        layout: the bucket layout passed to the compressor in every round.
    """
    check_cf(cf)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    x = grads[0]
    device = x.device
    size = x.numel()
    truth = torch.stack([g.double() for g in grads]).mean(dim=0)

    def nmse_round(c: Compressor) -> SimulationResult:
        sim = c if layout is None else _with_layout(c, layout)
        return simulate(sim, grads, cf, step=BENCH_STEP)

    instances = _Instances(name)
    result = instances.prime(nmse_round)
    error = nmse(result.mean, truth)
    del truth

    # The payloads combine() is timed on, from the state the timed compress calls start from.
    base = instances.get()
    rnd = _agreed_round(base, grads, cf, layout)
    compressed = [base.compress(g, cf, rnd) for g in grads]
    payloads = [p for p, _ in compressed]
    ctx = compressed[0][1]
    dst = torch.empty_like(x)

    def prepare_copy() -> Callable[[], object]:
        return lambda: dst.copy_(x)

    def prepare_compress() -> Callable[[], object]:
        c = instances.get()

        def call() -> object:
            c.local_stats(x, cf, rnd)
            return c.compress(x, cf, rnd)

        return call

    def prepare_combine() -> Callable[[], object]:
        c = instances.get()
        return lambda: c.combine(payloads, ctx)

    copy_s, compress_s, decompress_s = _interleaved_medians(
        [prepare_copy, prepare_compress, prepare_combine], repeats=repeats, device=device
    )
    nbytes = size * ELEMENT_BYTES
    input_gbps = _gbps(nbytes, compress_s)
    copy_gbps = _gbps(nbytes, copy_s)
    return CompressorResult(
        name=name,
        collective=base.collective,
        stateful=instances.stateful,
        size=size,
        workers=len(grads),
        repeats=repeats,
        cf_requested=cf,
        achieved_cf=float(result.achieved_cf),
        wire_bytes=max(max(result.wire_bytes), max(wire_bytes(p) for p in payloads)),
        nmse=error,
        compress_s=compress_s,
        copy_s=copy_s,
        decompress_s=decompress_s,
        input_gbps=input_gbps,
        copy_gbps=copy_gbps,
        ratio_to_copy=input_gbps / copy_gbps,
        decompress_gbps=_gbps(nbytes, decompress_s),
    )


def bench_compressors(
    names: Sequence[str] | None = None,
    *,
    size: int,
    cf: float = DEFAULT_CF,
    workers: int = DEFAULT_WORKERS,
    repeats: int = DEFAULT_REPEATS,
    seed: int = DEFAULT_SEED,
    device: str | torch.device = "cpu",
) -> list[CompressorResult]:
    """:func:`bench_compressor` for each of ``names`` (default: every registered compressor).

    Raises:
        RuntimeError: a compressor failed; the message names it (the cause is chained).
    """
    grads = synthetic_gradients(size, workers, seed=seed, device=device)
    layout = model_layout(size)
    results = []
    for name in compressors.names() if names is None else names:
        try:
            results.append(bench_compressor(name, grads, cf=cf, repeats=repeats, layout=layout))
        except Exception as exc:
            raise RuntimeError(f"benchmark of compressor {name!r} failed: {exc}") from exc
    return results


# ----------------------------------------------------------------------------------------------
# gravac bench multilevel
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultilevelResult:
    """One row of ``gravac bench multilevel`` (times in seconds).

    ``ratio = direct_s / multilevel_s``: above 1, recompressing is the cheaper way to get both.
    """

    name: str
    size: int
    repeats: int
    cf1: float
    cf2: float
    achieved_cf1: float
    achieved_cf2_multilevel: float
    achieved_cf2_direct: float
    multilevel_s: float
    direct_s: float
    ratio: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""
        return {k: _finite_or_none(v) for k, v in dataclasses.asdict(self).items()}


def multilevel_names() -> list[str]:
    """Registered compressors whose instances declare ``supports_multilevel``."""
    return [n for n in compressors.names() if compressors.create(n).supports_multilevel]


def bench_multilevel(
    names: Sequence[str] | None = None,
    *,
    size: int,
    cf1: float = DEFAULT_CF1,
    cf2: float = DEFAULT_CF2,
    repeats: int = DEFAULT_REPEATS,
    seed: int = DEFAULT_SEED,
    device: str | torch.device = "cpu",
) -> list[MultilevelResult]:
    """Time compressing at ``cf1`` then recompressing to ``cf2`` against compressing twice.

    Multi-level is ``compress(x, cf1) + recompress(to cf2)``, direct is ``compress(x, cf1) +
    compress(x, cf2)``.

    Each ``compress`` includes its ``local_stats`` (the stats are reduced over the single worker,
    untimed); ``x`` is one synthetic gradient. ``names`` defaults to :func:`multilevel_names`.

    Raises:
        ValueError: ``cf1 >= cf2``, or a named compressor does not support multi-level.
        RuntimeError: a compressor failed; the message names it (the cause is chained).
    """
    check_cf(cf1, name="cf1")
    check_cf(cf2, name="cf2")
    if cf1 >= cf2:
        raise ValueError(f"cf1 must be below cf2 for multi-level compression, got {cf1} >= {cf2}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = multilevel_names() if names is None else list(names)
    unsupported = [n for n in names if not compressors.create(n).supports_multilevel]
    if unsupported:
        raise ValueError(
            f"compressors {unsupported} do not support multi-level; choose from "
            f"{multilevel_names()}"
        )
    (x,) = synthetic_gradients(size, 1, seed=seed, device=device)
    layout = model_layout(size)
    results = []
    for name in names:
        try:
            results.append(_bench_multilevel_one(name, x, cf1, cf2, repeats, layout))
        except Exception as exc:
            raise RuntimeError(f"multi-level benchmark of {name!r} failed: {exc}") from exc
    return results


def _bench_multilevel_one(
    name: str,
    x: Tensor,
    cf1: float,
    cf2: float,
    repeats: int,
    layout: tuple[torch.Size, ...],
) -> MultilevelResult:
    instances = _Instances(name)

    def both_rounds(c: Compressor) -> tuple[Round, Round]:
        return _agreed_round(c, [x], cf1, layout), _agreed_round(c, [x], cf2, layout)

    rnd1, rnd2 = instances.prime(both_rounds)

    def compress(c: Compressor, cf: float, rnd: Round) -> tuple[Payload, Context]:
        c.local_stats(x, cf, rnd)
        return c.compress(x, cf, rnd)

    def multilevel(c: Compressor) -> tuple[Context, Context]:
        payload, ctx1 = compress(c, cf1, rnd1)
        return ctx1, c.recompress(payload, ctx1, cf2, rnd2)[1]

    def direct(c: Compressor) -> tuple[Context, Context]:
        return compress(c, cf1, rnd1)[1], compress(c, cf2, rnd2)[1]

    def prepare(run: Callable[[Compressor], object]) -> Callable[[], Callable[[], object]]:
        def prepared() -> Callable[[], object]:
            c = instances.get()
            return lambda: run(c)

        return prepared

    ctx1, ctx2_multi = multilevel(instances.get())
    ctx2_direct = direct(instances.get())[1]
    multilevel_s, direct_s = _interleaved_medians(
        [prepare(multilevel), prepare(direct)], repeats=repeats, device=x.device
    )
    return MultilevelResult(
        name=name,
        size=x.numel(),
        repeats=repeats,
        cf1=cf1,
        cf2=cf2,
        achieved_cf1=float(ctx1.achieved_cf),
        achieved_cf2_multilevel=float(ctx2_multi.achieved_cf),
        achieved_cf2_direct=float(ctx2_direct.achieved_cf),
        multilevel_s=multilevel_s,
        direct_s=direct_s,
        ratio=direct_s / multilevel_s if multilevel_s > 0.0 else math.inf,
    )


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
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


def _describe_size(size: int) -> str:
    return f"{size:,} float32 elements ({size * ELEMENT_BYTES / 2**20:.1f} MiB)"


def _environment(device: torch.device) -> str:
    threads = torch.get_num_threads()
    plural = "" if threads == 1 else "s"
    return f"device {device}, torch {torch.__version__}, {threads} thread{plural}"


def format_compressor_table(
    results: Sequence[CompressorResult], *, seed: int, device: torch.device
) -> str:
    """The human-readable report of ``gravac bench compressors``: a header, then a table."""
    if not results:
        return "no compressors to benchmark"
    r0 = results[0]
    header = [
        f"gravac bench compressors: {_describe_size(r0.size)} per worker, CF {r0.cf_requested:g}"
        f" requested, {r0.workers} simulated workers, median of {r0.repeats} repeats after one"
        f" warm-up, seed {seed}, {_environment(device)}",
        "  compress GB/s: float32 input bytes / time of local_stats + compress of one worker's"
        " gradient (stats agreed beforehand; no communication)",
        "  copy GB/s:     the same bytes / time of dst.copy_(src) into a preallocated buffer,"
        " timed in the same loop; ratio = compress GB/s / copy GB/s",
        "  decomp GB/s:   float32 output bytes / time of combine() of the N workers' payloads"
        " (all-reduce compressors: includes the payload sum)",
        "  NMSE:          ||mean_hat - mean||^2 / ||mean||^2 of one simulated round, no error"
        " feedback; wire B: bytes per worker",
        f"  gradients:     sigma*(z + {NOISE_RATIO:g}*eps_i), sigma log-normal(0,"
        f" {LOG_SCALE_STD:g}) and z shared, eps_i per worker; 1 GB = 1e9 bytes",
    ]
    headers = [
        "compressor",
        "collective",
        "CF",
        "wire B",
        "NMSE",
        "compress GB/s",
        "copy GB/s",
        "ratio",
        "decomp GB/s",
    ]
    rows = [
        [
            r.name + (" *" if r.stateful else ""),
            r.collective,
            f"{r.achieved_cf:.1f}",
            f"{r.wire_bytes:,}",
            f"{r.nmse:.3g}",
            f"{r.input_gbps:.3g}",
            f"{r.copy_gbps:.3g}",
            f"{r.ratio_to_copy:.3g}",
            f"{r.decompress_gbps:.3g}",
        ]
        for r in results
    ]
    footer = []
    if any(r.stateful for r in results):
        footer.append("* stateful: each timed call starts from the state after the NMSE round")
    return "\n".join([*header, "", _table(headers, rows), *footer])


def format_multilevel_table(
    results: Sequence[MultilevelResult], *, seed: int, device: torch.device
) -> str:
    """The human-readable report of ``gravac bench multilevel``: a header, then a table."""
    if not results:
        return "no registered compressor supports multi-level compression"
    r0 = results[0]
    header = [
        f"gravac bench multilevel: {_describe_size(r0.size)}, CF {r0.cf1:g} -> {r0.cf2:g},"
        f" median of {r0.repeats} repeats after one warm-up, seed {seed}, {_environment(device)}",
        "  multi-level: compress(x, cf1) + recompress(to cf2); direct: compress(x, cf1) +"
        " compress(x, cf2); each compress includes local_stats",
        "  ratio = direct / multi-level (the GraVAC paper reports 1.1x-1.83x)",
    ]
    headers = ["compressor", "CF1", "CF2 multi", "CF2 direct", "multi ms", "direct ms", "ratio"]
    rows = [
        [
            r.name,
            f"{r.achieved_cf1:.1f}",
            f"{r.achieved_cf2_multilevel:.1f}",
            f"{r.achieved_cf2_direct:.1f}",
            f"{r.multilevel_s * 1e3:.3g}",
            f"{r.direct_s * 1e3:.3g}",
            f"{r.ratio:.2f}",
        ]
        for r in results
    ]
    return "\n".join([*header, "", _table(headers, rows)])


def _dump_json(rows: Sequence[CompressorResult] | Sequence[MultilevelResult]) -> str:
    return json.dumps([r.to_json() for r in rows], indent=2, allow_nan=False)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Turn a parser's ValueError into argparse's error (its message is printed verbatim)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _positive_int(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{option} must be an integer >= 1, got {text!r}")
        return value

    return _argtype(parse)


def _cf(option: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return check_cf(float(text), name=option)
        except ValueError:
            raise ValueError(f"{option} must be a finite number >= 1, got {text!r}") from None

    return _argtype(parse)


def _int(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{option} must be an integer, got {text!r}") from None

    return _argtype(parse)


def _compressor_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = compressors.names()
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(
            f"--compressors must be a comma-separated list of registered compressors {known}, "
            f"got {text!r}"
        )
    return names


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(
            f"--device must be a torch device such as cpu or cuda, got {text!r}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text!r} was requested but CUDA is not available")
    return device


def _add_common(p: argparse.ArgumentParser, *, cf: bool) -> None:
    p.add_argument(
        "--size",
        type=_argtype(parse_size),
        default=parse_size(DEFAULT_SIZE),
        help=f"elements per gradient, K/M/G suffixes binary (default {DEFAULT_SIZE})",
    )
    if cf:
        p.add_argument(
            "--cf",
            type=_cf("--cf"),
            default=DEFAULT_CF,
            help=f"requested compression factor (default {DEFAULT_CF:g})",
        )
    p.add_argument(
        "--repeats",
        type=_positive_int("--repeats"),
        default=DEFAULT_REPEATS,
        help=f"timed repeats; medians are reported (default {DEFAULT_REPEATS})",
    )
    p.add_argument(
        "--compressors",
        type=_argtype(_compressor_list),
        default=None,
        help="comma-separated compressor names (default: every registered one that applies)",
    )
    p.add_argument(
        "--seed",
        type=_int("--seed"),
        default=DEFAULT_SEED,
        help=f"seed of the synthetic gradients (default {DEFAULT_SEED})",
    )
    p.add_argument(
        "--device",
        type=_argtype(_device),
        default=torch.device("cpu"),
        help="torch device to run on (default cpu; CUDA times are synchronised)",
    )
    p.add_argument(
        "--threads",
        type=_positive_int("--threads"),
        default=None,
        help="torch intra-op threads while benchmarking (default: torch's, all cores); 1 is "
        "steadier on a machine shared with other jobs",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list of rows, no table")


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``threads`` torch intra-op threads (``None``: unchanged), restored afterwards."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run_compressors(args: argparse.Namespace) -> int:
    with _torch_threads(args.threads):
        return _report_compressors(args)


def _run_multilevel(args: argparse.Namespace) -> int:
    with _torch_threads(args.threads):
        return _report_multilevel(args)


def _report_compressors(args: argparse.Namespace) -> int:
    results = bench_compressors(
        args.compressors,
        size=args.size,
        cf=args.cf,
        workers=args.workers,
        repeats=args.repeats,
        seed=args.seed,
        device=args.device,
    )
    if args.json:
        print(_dump_json(results))
    else:
        print(format_compressor_table(results, seed=args.seed, device=args.device))
    return 0


def _report_multilevel(args: argparse.Namespace) -> int:
    results = bench_multilevel(
        args.compressors,
        size=args.size,
        cf1=args.cf1,
        cf2=args.cf2,
        repeats=args.repeats,
        seed=args.seed,
        device=args.device,
    )
    if args.json:
        print(_dump_json(results))
    else:
        print(format_multilevel_table(results, seed=args.seed, device=args.device))
    return 0


def _check_multilevel_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors that need several options (argparse exits with status 2)."""
    if args.cf1 >= args.cf2:
        parser.error(f"--cf1 must be below --cf2, got {args.cf1:g} >= {args.cf2:g}")
    supported = multilevel_names()
    unsupported = [n for n in args.compressors or () if n not in supported]
    if unsupported:
        parser.error(
            f"--compressors {','.join(unsupported)} do not support multi-level; "
            f"choose from {supported}"
        )


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench compressors`` and ``bench multilevel`` to the ``gravac`` command line.

    Each leaf parser sets ``func`` (the handler, taking the parsed namespace and returning an
    exit status) as :func:`gravac.cli.main` expects.
    """
    bench = subparsers.add_parser(
        "bench",
        help="benchmark the compressors",
        description="Benchmarks of the registered compressors (times are medians).",
    )
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    comp = kinds.add_parser(
        "compressors",
        help="throughput, NMSE, achieved CF and wire bytes of each compressor",
        description=(
            "For each compressor: compress GB/s = float32 input bytes / median time of "
            "local_stats + compress of one worker's gradient (the cross-rank reduction of the "
            "stats is not timed); copy GB/s = the same bytes / median time of dst.copy_(src) "
            "into a preallocated buffer, measured in the same loop, and their ratio; "
            "decompress GB/s = float32 output bytes / median time of combine() of the N "
            "workers' payloads; NMSE of the N-worker mean of one simulated round "
            "(gravac.simulation.simulate, no error feedback) on synthetic heavy-tailed "
            "gradients (a shared component plus per-worker noise); achieved CF; wire bytes per "
            "worker. One untimed warm-up precedes the timed repeats."
        ),
    )
    _add_common(comp, cf=True)
    comp.add_argument(
        "--workers",
        type=_positive_int("--workers"),
        default=DEFAULT_WORKERS,
        help=f"simulated workers, in process (default {DEFAULT_WORKERS})",
    )
    comp.set_defaults(func=_run_compressors)

    multi = kinds.add_parser(
        "multilevel",
        help="multi-level compression (compress then recompress) versus compressing twice",
        description=(
            "For each compressor that supports multi-level compression: median time of "
            "local_stats + compress(x, cf1) + recompress(to cf2) against local_stats + "
            "compress(x, cf1) + local_stats + compress(x, cf2), and their ratio "
            "(direct / multi-level; the GraVAC paper reports 1.1x-1.83x)."
        ),
    )
    _add_common(multi, cf=False)
    multi.add_argument(
        "--cf1",
        type=_cf("--cf1"),
        default=DEFAULT_CF1,
        help=f"first-level CF, theta_min (default {DEFAULT_CF1:g})",
    )
    multi.add_argument(
        "--cf2",
        type=_cf("--cf2"),
        default=DEFAULT_CF2,
        help=f"second-level CF, the candidate (default {DEFAULT_CF2:g})",
    )

    def run_multilevel(args: argparse.Namespace) -> int:
        _check_multilevel_args(multi, args)
        return _run_multilevel(args)

    multi.set_defaults(func=run_multilevel)
