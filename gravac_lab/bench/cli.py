"""``gravac bench``'s command line: ``gravac bench compressors``, ``multilevel``, ``kernels``,
``shadow``, ``memory`` and ``step``.

:func:`add_parser` adds both to the ``gravac`` command line (:mod:`gravac.cli`); the handlers run
the benchmarks of :mod:`gravac_lab.bench.compressors` and :mod:`gravac_lab.bench.multilevel` with
torch's intra-op threads set by ``--threads``, and print a table or, with ``--json``, a JSON list of
rows.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gravac import compressors
from gravac.argtypes import argtype
from gravac.compressors import check_cf
from gravac_lab.bench import compressors as compressor_bench
from gravac_lab.bench import kernels as kernel_bench
from gravac_lab.bench import memory as memory_bench
from gravac_lab.bench import multilevel as multilevel_bench
from gravac_lab.bench import shadow as shadow_bench
from gravac_lab.bench import step as step_bench
from gravac_lab.bench.common import DEFAULT_REPEATS, DEFAULT_SEED, DEFAULT_SIZE, parse_size
from gravac_lab.compare import workloads

__all__ = ["add_parser"]


def _positive_int(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{option} must be an integer >= 1, got {text!r}")
        return value

    return argtype(parse)


def _cf(option: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return check_cf(float(text), name=option)
        except ValueError:
            raise ValueError(f"{option} must be a finite number >= 1, got {text!r}") from None

    return argtype(parse)


def _int(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{option} must be an integer, got {text!r}") from None

    return argtype(parse)


def _fraction(option: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{option} must be a fraction in [0, 1], got {text!r}")
        return value

    return argtype(parse)


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


def _add_common(p: argparse.ArgumentParser, *, cf: bool, selection: bool = True) -> None:
    p.add_argument(
        "--size",
        type=argtype(parse_size),
        default=parse_size(DEFAULT_SIZE),
        help=f"elements per gradient, K/M/G suffixes binary (default {DEFAULT_SIZE})",
    )
    if cf:
        p.add_argument(
            "--cf",
            type=_cf("--cf"),
            default=compressor_bench.DEFAULT_CF,
            help=f"requested compression factor (default {compressor_bench.DEFAULT_CF:g})",
        )
    p.add_argument(
        "--repeats",
        type=_positive_int("--repeats"),
        default=DEFAULT_REPEATS,
        help=f"timed repeats; medians are reported (default {DEFAULT_REPEATS})",
    )
    p.add_argument(
        "--seed",
        type=_int("--seed"),
        default=DEFAULT_SEED,
        help=f"seed of the synthetic gradients (default {DEFAULT_SEED})",
    )
    p.add_argument(
        "--device",
        type=argtype(_device),
        default=torch.device("cpu"),
        help="torch device to run on (default cpu; CUDA times are synchronised)",
    )
    _add_selection(p, selection=selection)


def _add_selection(p: argparse.ArgumentParser, *, selection: bool = True) -> None:
    """``--threads`` and ``--json``, which every benchmark takes, and ``--compressors`` where
    it chooses among them (``selection``)."""
    if selection:
        p.add_argument(
            "--compressors",
            type=argtype(_compressor_list),
            default=None,
            help="comma-separated compressor names (default: every registered one that applies)",
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


def _run(
    args: argparse.Namespace,
    bench: Callable[..., Sequence[Any]],
    table: Callable[..., str],
    **options: Any,
) -> int:
    """Run ``bench`` with the common options and ``options`` under ``--threads``; print."""
    with _torch_threads(args.threads):
        _print(args, bench(**options, **_common_options(args)), table)
    return 0


def _run_compressors(args: argparse.Namespace) -> int:
    return _run(
        args,
        compressor_bench.bench_compressors,
        functools.partial(compressor_bench.format_compressor_table, subnormal=args.subnormal),
        names=args.compressors,
        cf=args.cf,
        workers=args.workers,
        subnormal=args.subnormal,
    )


def _run_multilevel(args: argparse.Namespace) -> int:
    return _run(
        args,
        multilevel_bench.bench_multilevel,
        multilevel_bench.format_multilevel_table,
        names=args.compressors,
        cf1=args.cf1,
        cf2=args.cf2,
    )


def _run_shadow(args: argparse.Namespace) -> int:
    return _run(args, shadow_bench.bench_shadow, shadow_bench.format_shadow_table)


def _run_kernels(args: argparse.Namespace) -> int:
    return _run(args, kernel_bench.bench_kernels, kernel_bench.format_kernel_table)


def _run_memory(args: argparse.Namespace) -> int:
    results = memory_bench.bench_memory(
        names=args.compressors,
        params=args.params,
        steps=args.steps,
        threads=args.threads,
        width=args.width,
        front=args.front,
        policy=args.policy,
        cf=args.cf,
        set_to_none=args.set_to_none,
    )
    _show(args, results, memory_bench.format_memory_table)
    return 0


def _run_step(args: argparse.Namespace) -> int:
    with _torch_threads(args.threads):
        results = step_bench.bench_step(
            workload=args.workload,
            steps=args.steps,
            warmup=args.warmup,
            policy=args.policy,
            cf=args.cf,
            device=args.device,
            workers=args.workers,
        )
        _show(args, results, step_bench.format_step_table)
    return 0


def _show(args: argparse.Namespace, results: Sequence[Any], table: Callable[[Any], str]) -> None:
    """Print ``results`` as a JSON list of rows (``--json``) or as ``table(results)``."""
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2, allow_nan=False))
    else:
        print(table(results))


def _common_options(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark arguments of the options :func:`_add_common` adds to both benchmarks."""
    return {"size": args.size, "repeats": args.repeats, "seed": args.seed, "device": args.device}


def _print(
    args: argparse.Namespace,
    results: Sequence[compressor_bench.CompressorResult]
    | Sequence[multilevel_bench.MultilevelResult]
    | Sequence[kernel_bench.KernelResult]
    | Sequence[shadow_bench.ShadowResult],
    table: Callable[..., str],
) -> None:
    """Print ``results`` as a JSON list of rows (``--json``) or as the report ``table`` makes.

    Called with the benchmark's torch threads still set: the report's header names them.
    """
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2, allow_nan=False))
    else:
        print(table(results, seed=args.seed, device=args.device))


def _check_multilevel_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors that need several options (argparse exits with status 2)."""
    if args.cf1 >= args.cf2:
        parser.error(f"--cf1 must be below --cf2, got {args.cf1:g} >= {args.cf2:g}")
    supported = multilevel_bench.multilevel_names()
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
        default=compressor_bench.DEFAULT_WORKERS,
        help=f"simulated workers, in process (default {compressor_bench.DEFAULT_WORKERS})",
    )
    comp.add_argument(
        "--subnormal",
        type=_fraction("--subnormal"),
        default=0.0,
        help="fraction of each gradient (its last elements) scaled by 2^-130 into float32's "
        "subnormal range, as error feedback leaves blocks of zero gradients (default 0)",
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
        default=multilevel_bench.DEFAULT_CF1,
        help=f"first-level CF, theta_min (default {multilevel_bench.DEFAULT_CF1:g})",
    )
    multi.add_argument(
        "--cf2",
        type=_cf("--cf2"),
        default=multilevel_bench.DEFAULT_CF2,
        help=f"second-level CF, the candidate (default {multilevel_bench.DEFAULT_CF2:g})",
    )

    def run_multilevel(args: argparse.Namespace) -> int:
        _check_multilevel_args(multi, args)
        return _run_multilevel(args)

    multi.set_defaults(func=run_multilevel)

    shadow = kinds.add_parser(
        "shadow",
        help="what the search by shadow adds to a step: sampling and replaying its ladder",
        description=(
            "For the exponential and the geometric policies' ladders (CFs 10 to 1000): median "
            "time of the replayed sample of x - e and of one replay step (a top-k per CF of "
            "the ladder on the sample, gravac.control.replay), against dst.copy_(src) of the "
            "float32 gradient in the same loop, their ratio, and the shadows' memory over the "
            "gradient's."
        ),
    )
    _add_common(shadow, cf=False, selection=False)
    shadow.set_defaults(func=_run_shadow)

    kern = kinds.add_parser(
        "kernels",
        help="each CuPy kernel against its torch path and a plain copy (CUDA only)",
        description=(
            "For each CuPy kernel (top-k and threshold selection, scatter-add, the 16-bit "
            "scaled casts, THC compression and its unpack + sum): median time of the torch "
            "path, of the CuPy path and of dst.copy_(src) of the float32 input, synchronised, "
            "interleaved in one loop; speedup = torch / CuPy, of copy = copy / CuPy. Needs "
            "--device cuda and CuPy."
        ),
    )
    _add_common(kern, cf=False)
    kern.set_defaults(func=_run_kernels, device=torch.device("cuda"))

    mem = kinds.add_parser(
        "memory",
        help="extra peak memory of a training step, per compressor (Linux)",
        description=(
            "For each compressor, in a fresh process: a stack of Linear(W, W) layers (W = "
            "--width) of about --params float32 parameters trains with plain SGD, then with "
            "GravacOptimizer around it (one worker; by default CF 10 with a search candidate "
            "from the first step, see --policy); the peak resident memory of backward() + "
            "step() above plain SGD's steady state, less plain SGD's own peak, in MiB and in "
            "gradients (target <= 2)."
        ),
    )
    mem.add_argument(
        "--params",
        type=argtype(lambda text: parse_size(text, option="--params")),
        default=memory_bench.DEFAULT_PARAMS,
        help="parameters of the model, K/M/G suffixes binary, rounded to whole W x W "
        "layers (default 50M)",
    )
    mem.add_argument(
        "--width",
        type=_positive_int("--width"),
        default=memory_bench.WIDTH,
        help=f"W, the layers' width (default {memory_bench.WIDTH}: 16 MiB layers, one a "
        "bucket; 7168 makes 50M parameters one 196 MiB tensor, which the optimizer splits "
        "across 8 buckets and DDP keeps whole)",
    )
    mem.add_argument(
        "--front",
        choices=memory_bench.FRONTS,
        default="optimizer",
        help="GravacOptimizer around SGD (default), or the DDP comm hook on a one-process gloo "
        "group, against plain DDP",
    )
    mem.add_argument(
        "--steps",
        type=_positive_int("--steps"),
        default=memory_bench.DEFAULT_STEPS,
        help=f"steps of each optimizer (default {memory_bench.DEFAULT_STEPS})",
    )
    mem.add_argument(
        "--policy",
        choices=memory_bench.POLICIES,
        default="candidate",
        help="what the optimizer sends: CF 10 with a candidate at every step (default), a "
        "static CF (--cf), or the defaults (the adaptive search)",
    )
    mem.add_argument(
        "--cf",
        type=_cf("--cf"),
        default=memory_bench.FIXED_CF,
        help=f"the static CF of --policy fixed (default {memory_bench.FIXED_CF:g})",
    )
    mem.add_argument(
        "--set-to-none",
        action="store_true",
        help="zero_grad(set_to_none=True) between steps (torch's default: each backward makes "
        "fresh gradients); without it the gradients are zeroed in place",
    )
    _add_selection(mem)
    mem.set_defaults(func=_run_memory)

    step = kinds.add_parser(
        "step",
        help="what gravac adds to a training step of a real model, on one device",
        description=(
            "On a one-process gloo group: plain SGD, GravacOptimizer around it, DDP and DDP "
            "with the gravac hook train copies of a workload's model on the same batches, one "
            "step each in turn; the median step of each gravac front over its plain "
            "counterpart's (ratio) and gravac's share of a plain step (extra = ratio - 1; "
            "target <= 0.10 at Top-k CF 100). CUDA steps are synchronised."
        ),
    )
    step.add_argument(
        "--workload",
        choices=workloads.names(),
        default="vgg-digits",
        help="the model and data (default vgg-digits; mlp-digits is the wide MLP)",
    )
    step.add_argument(
        "--steps",
        type=_positive_int("--steps"),
        default=step_bench.DEFAULT_STEPS,
        help=f"timed steps of each front (default {step_bench.DEFAULT_STEPS})",
    )
    step.add_argument(
        "--warmup",
        type=_positive_int("--warmup"),
        default=step_bench.DEFAULT_WARMUP,
        help=f"untimed steps of each front first (default {step_bench.DEFAULT_WARMUP})",
    )
    step.add_argument(
        "--policy",
        choices=step_bench.POLICIES,
        default="fixed",
        help="what gravac sends: Top-k at a static CF (--cf; default), or the default search",
    )
    step.add_argument(
        "--cf",
        type=_cf("--cf"),
        default=step_bench.DEFAULT_CF,
        help=f"the static CF (default {step_bench.DEFAULT_CF:g})",
    )
    step.add_argument(
        "--device",
        type=argtype(_device),
        default=torch.device("cpu"),
        help="torch device to run on (default cpu; CUDA times are synchronised)",
    )
    step.add_argument(
        "--workers",
        type=_positive_int("--workers"),
        default=1,
        help="processes sharing the device on one gloo group (default 1: in this process; "
        "with more, rank 0's times)",
    )
    _add_selection(step, selection=False)
    step.set_defaults(func=_run_step)
