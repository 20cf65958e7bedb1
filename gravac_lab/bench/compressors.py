"""``gravac bench compressors``: throughput, NMSE, achieved CF and wire bytes of each compressor.

Measures, for every registered compressor (or those named), on one process:

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
* **error feedback**: the residual ``x - D(payload)`` as the engine updates it, in ``x``'s
  storage (:meth:`Compressor.residual_`: a sparsifier zeroes its ``k`` sent positions, the
  CLAN / BytePS-Compress paper's O(k) update), against the update through a dense
  decompression (``x.sub_(decompress(payload))``, O(d) and a gradient-sized temporary), both on
  a fresh copy of ``x`` made untimed; ``ef_ratio`` is the first over the second;
* **NMSE** of the N-worker mean estimate of one round, ``||mean_hat - mean||^2 / ||mean||^2``,
  from :func:`gravac.simulation.simulate` with a fresh compressor and no error feedback, and the
  achieved CF and wire bytes per worker of that round.

Times, gradients and layout are those of :mod:`gravac_lab.bench.common`.

Stateful compressors (PowerSGD's warm start, updated in ``combine``) are primed by the NMSE round;
their :meth:`Compressor.state_dict` is then snapshotted, and each timed call runs on a fresh
instance loaded with that snapshot, so that every repeat starts from the same state. Stateless
compressors (empty ``state_dict``) reuse the primed instance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gravac import compressors
from gravac.compressors import Compressor, check_cf, wire_bytes
from gravac.compressors.base import local_stats
from gravac.simulation import SimulationResult, simulate
from gravac_lab.bench.common import (
    BENCH_STEP,
    DEFAULT_REPEATS,
    DEFAULT_SEED,
    ELEMENT_BYTES,
    LOG_SCALE_STD,
    NOISE_RATIO,
    Instances,
    agreed_round,
    bench_each,
    describe_size,
    environment,
    format_table,
    gbps,
    interleaved_medians,
    json_row,
    model_layout,
    nmse,
    synthetic_gradients,
)

__all__ = [
    "CompressorResult",
    "bench_compressor",
    "bench_compressors",
    "format_compressor_table",
]

# Defaults of the command-line options of ``gravac bench compressors``.
DEFAULT_CF = 100.0
DEFAULT_WORKERS = 4


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
    feedback_s: float
    dense_feedback_s: float
    ef_ratio: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""
        return json_row(self)


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
        return simulate(c, grads, cf, step=BENCH_STEP, layout=layout)

    instances = Instances(name)
    result = instances.prime(nmse_round)
    error = nmse(result.mean, truth)
    del truth

    # The payloads combine() is timed on, from the state the timed compress calls start from.
    base = instances.get()
    rnd = agreed_round(base, grads, cf, layout)
    compressed = [base.compress(g, cf, rnd) for g in grads]
    payloads = [p for p, _ in compressed]
    ctx = compressed[0][1]
    dst = torch.empty_like(x)

    def prepare_copy() -> Callable[[], object]:
        return lambda: dst.copy_(x)

    def prepare_compress() -> Callable[[], object]:
        c = instances.get()

        def call() -> object:
            local_stats(c, x, cf, rnd)
            return c.compress(x, cf, rnd)

        return call

    def prepare_combine() -> Callable[[], object]:
        c = instances.get()
        return lambda: c.combine(payloads, ctx)

    def prepare_feedback() -> Callable[[], object]:
        c, fresh = instances.get(), x.clone()
        return lambda: c.residual_(fresh, payloads[0], ctx)

    def prepare_dense_feedback() -> Callable[[], object]:
        c, fresh = instances.get(), x.clone()
        return lambda: fresh.sub_(c.decompress(payloads[0], ctx))

    cases = [prepare_copy, prepare_compress, prepare_combine]
    times = interleaved_medians(
        [*cases, prepare_feedback, prepare_dense_feedback], repeats=repeats, device=device
    )
    copy_s, compress_s, decompress_s, feedback_s, dense_feedback_s = times
    nbytes = size * ELEMENT_BYTES
    input_gbps = gbps(nbytes, compress_s)
    copy_gbps = gbps(nbytes, copy_s)
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
        decompress_gbps=gbps(nbytes, decompress_s),
        feedback_s=feedback_s,
        dense_feedback_s=dense_feedback_s,
        ef_ratio=feedback_s / dense_feedback_s,
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
    subnormal: float = 0.0,
) -> list[CompressorResult]:
    """:func:`bench_compressor` for each of ``names`` (default: every registered compressor),
    on gradients whose last ``subnormal`` fraction is subnormal (:func:`synthetic_gradients`).

    Raises:
        RuntimeError: a compressor failed; the message names it (the cause is chained).
    """
    grads = synthetic_gradients(size, workers, seed=seed, device=device, subnormal=subnormal)
    layout = model_layout(size)
    return bench_each(
        compressors.names() if names is None else names,
        lambda name: bench_compressor(name, grads, cf=cf, repeats=repeats, layout=layout),
        failure="benchmark of compressor {name!r} failed",
    )


def format_compressor_table(
    results: Sequence[CompressorResult],
    *,
    seed: int,
    device: torch.device,
    subnormal: float = 0.0,
) -> str:
    """The human-readable report of ``gravac bench compressors``: a header, then a table."""
    if not results:
        return "no compressors to benchmark"
    r0 = results[0]
    header = [
        f"gravac bench compressors: {describe_size(r0.size)} per worker, CF {r0.cf_requested:g}"
        f" requested, {r0.workers} simulated workers, median of {r0.repeats} repeats after one"
        f" warm-up, seed {seed}, {environment(device)}",
        "  compress GB/s: float32 input bytes / time of local_stats + compress of one worker's"
        " gradient (stats agreed beforehand; no communication)",
        "  copy GB/s:     the same bytes / time of dst.copy_(src) into a preallocated buffer,"
        " timed in the same loop; ratio = compress GB/s / copy GB/s",
        "  decomp GB/s:   float32 output bytes / time of combine() of the N workers' payloads"
        " (all-reduce compressors: includes the payload sum)",
        "  EF ms:         time of the residual update x - D(payload) in x's storage, as the"
        " engine runs it (sparsifiers: the k sent positions zeroed); EF ratio = it / the same by"
        " x.sub_(decompress(payload))",
        "  NMSE:          ||mean_hat - mean||^2 / ||mean||^2 of one simulated round, no error"
        " feedback; wire B: bytes per worker",
        f"  gradients:     sigma*(z + {NOISE_RATIO:g}*eps_i), sigma log-normal(0,"
        f" {LOG_SCALE_STD:g}) and z shared, eps_i per worker"
        + (f", the last {subnormal:g} of them times 2^-130 (subnormal)" if subnormal else "")
        + "; 1 GB = 1e9 bytes",
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
        "EF ms",
        "EF ratio",
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
            f"{r.feedback_s * 1e3:.3g}",
            f"{r.ef_ratio:.3g}",
        ]
        for r in results
    ]
    footer = []
    if any(r.stateful for r in results):
        footer.append("* stateful: each timed call starts from the state after the NMSE round")
    return "\n".join([*header, "", format_table(headers, rows), *footer])
