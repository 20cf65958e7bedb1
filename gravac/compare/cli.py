"""``gravac compare``'s command line: options, ``--quick``, the table on stdout, JSON to ``--out``.

:func:`add_parser` adds ``gravac compare`` to the ``gravac`` command line (:mod:`gravac.cli`).
Option values argparse cannot check (a bad ``--modes`` list, ``--bandwidth`` string or JSON
option) are rejected while parsing, and the rest by :class:`CompareConfig`, both with status 2
and a message naming the option. A failed job prints its error and returns status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gravac import compressors, policies
from gravac.argtypes import argtype
from gravac.compare import modes, workloads
from gravac.compare.config import (
    DEFAULT_EVAL_EVERY,
    DEFAULT_LINK_TEST_MB,
    DEFAULT_MODES,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT,
    DEFAULT_TIMING_WARMUP,
    QUICK_EVAL_EVERY,
    QUICK_LINK_TEST_MB,
    QUICK_MODES,
    QUICK_STEPS,
    CompareConfig,
)
from gravac.compare.netns import NetworkError, parse_delay, parse_rate
from gravac.compare.report import format_table
from gravac.compare.runner import CompareError, run_compare
from gravac.controller import ControllerConfig

__all__ = ["add_parser"]


def _mode_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"--modes must be a comma-separated list of {modes.names()}, got {text!r}")
    for name in names:
        modes.get(name)
    return names


def _json_object(option: str) -> Callable[[str], dict[str, Any]]:
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(
                f"{option} must be a JSON object such as '{{\"cf\": 100}}', got {text!r}"
            )
        return value

    return parse


def _checked_string(parse: Callable[[str], object]) -> Callable[[str], str]:
    """Keep the string (``tc`` takes it as written) once ``parse`` accepts it."""

    def check(text: str) -> str:
        parse(text)
        return text

    return check


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except ``None``: those options say theirs in their help
    (it depends on --quick or on the workload)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers: Any) -> None:
    """Register ``gravac compare``."""
    d = CompareConfig()
    p = subparsers.add_parser(
        "compare",
        help="measure DDP, its compression hooks and gravac on the same run",
        description=(
            "Train the same workload in several modes, one after another on the same seeds, "
            "and report per-step time and its split, bytes sent and time to target accuracy. "
            "With --bandwidth (as root) every worker runs in its own network namespace behind a "
            "tc-shaped veth link; otherwise on loopback."
        ),
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--modes",
        type=argtype(_mode_list),
        default=None,
        help=f"comma-separated modes from {modes.names()} "
        f"(default {','.join(DEFAULT_MODES)}; --quick: {','.join(QUICK_MODES)})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"CI smoke run: workload {workloads.QUICK_WORKLOAD}, {QUICK_STEPS} steps, "
        f"{len(QUICK_MODES)} modes, unless given",
    )
    p.add_argument(
        "--workload",
        choices=workloads.names(),
        default=None,
        help=f"what to train (default {workloads.DEFAULT_WORKLOAD})",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes")
    p.add_argument(
        "--steps", type=int, default=None, help=f"training steps per mode (default {DEFAULT_STEPS})"
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per worker")
    p.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help=f"steps between test evaluations, off the clock (default {DEFAULT_EVAL_EVERY})",
    )
    p.add_argument(
        "--timing-warmup",
        type=int,
        default=DEFAULT_TIMING_WARMUP,
        help="first steps left out of the per-step medians",
    )
    p.add_argument(
        "--target", type=float, default=None, help="time-to-target accuracy (the workload's)"
    )
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    p.add_argument("--compressor", default=d.compressor, choices=compressors.names())
    p.add_argument(
        "--compressor-options",
        type=argtype(_json_object("--compressor-options")),
        default={},
        help="JSON object of compressor options",
    )
    p.add_argument("--policy", default=d.policy, choices=policies.names())
    p.add_argument(
        "--policy-options",
        type=argtype(_json_object("--policy-options")),
        default={},
        help="""JSON object of policy options, e.g. '{"cf": 100}' for --policy fixed""",
    )
    p.add_argument(
        "--theta-min", type=float, default=ControllerConfig.theta_min, help="lowest CF searched"
    )
    p.add_argument(
        "--theta-max", type=float, default=ControllerConfig.theta_max, help="highest CF searched"
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="gravac mode: compress and send in step(), not during backward",
    )
    p.add_argument(
        "--powersgd-rank", type=int, default=d.powersgd_rank, help="PowerSGD's matrix rank"
    )
    p.add_argument(
        "--powersgd-start",
        type=int,
        default=d.powersgd_start,
        help="PowerSGD's start_powerSGD_iter (float32 all-reduce before it)",
    )
    p.add_argument(
        "--bandwidth",
        type=argtype(_checked_string(parse_rate)),
        default=None,
        help="link rate as tc writes it (1gbit, 100mbit); needs root (default: loopback)",
    )
    p.add_argument(
        "--delay",
        type=argtype(_checked_string(parse_delay)),
        default=None,
        help="one-way link delay (1ms; netem), with --bandwidth",
    )
    p.add_argument(
        "--link-test-mb",
        type=int,
        default=None,
        help=f"MiB all-reduced to measure a shaped link, 0: none (default {DEFAULT_LINK_TEST_MB}"
        f"; --quick: {QUICK_LINK_TEST_MB})",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds one job (a mode, or the link test) may take",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    p.set_defaults(func=_main)


def _pick(value: Any, quick: bool, quick_value: Any, default: Any) -> Any:
    """An option's value: as given, else ``--quick``'s, else the default."""
    if value is not None:
        return value
    return quick_value if quick else default


def _main(args: argparse.Namespace) -> int:
    q = args.quick
    cfg = CompareConfig(
        modes=_pick(args.modes, q, QUICK_MODES, DEFAULT_MODES),
        workload=_pick(args.workload, q, workloads.QUICK_WORKLOAD, workloads.DEFAULT_WORKLOAD),
        workers=args.workers,
        steps=_pick(args.steps, q, QUICK_STEPS, DEFAULT_STEPS),
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        eval_every=_pick(args.eval_every, q, QUICK_EVAL_EVERY, DEFAULT_EVAL_EVERY),
        timing_warmup=args.timing_warmup,
        target=args.target,
        threads=args.threads,
        compressor=args.compressor,
        compressor_options=args.compressor_options,
        policy=args.policy,
        policy_options=args.policy_options,
        theta_min=args.theta_min,
        theta_max=args.theta_max,
        overlap=not args.no_overlap,
        powersgd_rank=args.powersgd_rank,
        powersgd_start=args.powersgd_start,
        bandwidth=args.bandwidth,
        delay=args.delay,
        link_test_mb=_pick(args.link_test_mb, q, QUICK_LINK_TEST_MB, DEFAULT_LINK_TEST_MB),
        timeout=args.timeout,
    )
    try:
        summary = run_compare(cfg)
    except (CompareError, NetworkError) as exc:
        print(f"gravac compare: error: {exc}", file=sys.stderr)
        return 1
    table = format_table(summary)
    summary["table"] = table
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(table)
    return 0
