"""``gravac compare``'s command line: options, ``--quick``, the table on stdout, the files.

:func:`add_parser` adds ``gravac compare`` to the ``gravac`` command line (:mod:`gravac.cli`).
A study (:mod:`gravac_lab.compare.study`) is the modes, the gravac variants (``--variant``,
repeated; without it, the one variant of ``--compressor``, ``--policy`` and the options of
those and of the engine) and
the seeds (``--seeds``). The table goes to stdout; ``--out`` writes the JSON, ``--csv`` a row
a run, ``--plots`` the figures (:mod:`gravac_lab.compare.export`, :mod:`gravac_lab.compare.plots`).
``--scoreboard`` runs the scoreboard instead (:mod:`gravac_lab.compare.scoreboard_cli`).

Option values argparse cannot check (a bad ``--modes`` list, ``--variant``, ``--seeds``,
``--bandwidth`` string or JSON option) are rejected while parsing, and the rest by
:class:`CompareConfig` and :class:`Study` before any worker starts, all with status 2 and a
message naming the option. A failed job prints its error and returns status 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gravac import compressors, policies
from gravac.argtypes import argtype
from gravac.control.options import ControllerConfig
from gravac_lab.compare import modes, plots, scoreboard_cli, workloads
from gravac_lab.compare.config import (
    DEFAULT_EVAL_EVERY,
    DEFAULT_LINK_TEST_MB,
    DEFAULT_MODES,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT,
    DEFAULT_TIMING_WARMUP,
    OPTIMIZERS,
    QUICK_EVAL_EVERY,
    QUICK_LINK_TEST_MB,
    QUICK_MODES,
    QUICK_STEPS,
    STOP_HOLD,
    CompareConfig,
)
from gravac_lab.compare.export import write_csv, write_json
from gravac_lab.compare.layout import DEFAULT_WORKERS, NodeLayout, check_count
from gravac_lab.compare.netns import NetworkError, parse_delay, parse_rate
from gravac_lab.compare.report import format_table
from gravac_lab.compare.runner import CompareError, run_compare
from gravac_lab.compare.study import VARIANT_SYNTAX, Study, parse_seeds, parse_variant

__all__ = ["add_parser"]


def _mode_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"--modes must be a comma-separated list of {modes.names()}, got {text!r}")
    for name in names:
        modes.get(name)
    return names


def _milestones(text: str) -> tuple[int, ...]:
    """A ``--lr-milestones`` value: increasing steps >= 1, comma-separated (``150,250``).

    Raises:
        ValueError: naming ``--lr-milestones``, quoting ``text``, saying what is allowed.
    """
    parts = [p.strip() for p in text.split(",")]
    steps = [int(p) if p.isascii() and p.isdigit() else 0 for p in parts]
    if min(steps) < 1 or steps != sorted(set(steps)):
        raise ValueError(
            f"--lr-milestones must be increasing steps >= 1, comma-separated, got {text!r}"
        )
    return tuple(steps)


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


def _count(option: str) -> Callable[[str], int]:
    """A parser of ``option``'s value, an integer >= 1 (written in decimal)."""

    def parse(text: str) -> int:
        digits = text.strip()
        value = int(digits) if digits.isascii() and digits.isdigit() else None  # "-2", "1.5"
        return check_count(option, value, text=text)

    return parse


def _checked_string(parse: Callable[[str], object]) -> Callable[[str], str]:
    """Keep the string (``tc`` takes it as written) once ``parse`` accepts it."""

    def check(text: str) -> str:
        parse(text)
        return text

    return check


def _plots_dir(text: str) -> Path:
    plots.check_available()
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--plots must name a directory, got {text!r}, which is a file")
    return path


#: the single-variant options, which ``--variant`` replaces: (option, attribute)
_SINGLE_VARIANT = (
    ("--compressor", "compressor"),
    ("--compressor-options", "compressor_options"),
    ("--policy", "policy"),
    ("--policy-options", "policy_options"),
    ("--engine-options", "engine_options"),
)


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
            "tc-shaped veth link (with --nodes, every node: its workers share the namespace); "
            "otherwise on loopback."
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
    p.add_argument(
        "--workers",
        type=argtype(_count("--workers")),
        default=None,
        help=f"worker processes (default {DEFAULT_WORKERS}; with --nodes and --ranks-per-node: "
        "their product)",
    )
    p.add_argument(
        "--nodes",
        type=argtype(_count("--nodes")),
        default=None,
        help="emulated nodes of consecutive ranks (default 1: flat); with --bandwidth each node "
        "is one network namespace, its workers talking unshaped, the links between nodes "
        "shaped, and the table gives the inter-node MB a step; every worker gets torchrun's "
        "LOCAL_RANK and LOCAL_WORLD_SIZE",
    )
    p.add_argument(
        "--ranks-per-node",
        type=argtype(_count("--ranks-per-node")),
        default=None,
        help="workers per node (default: --workers / --nodes, or 1); --nodes x --ranks-per-node "
        "workers in all",
    )
    p.add_argument(
        "--steps", type=int, default=None, help=f"training steps per mode (default {DEFAULT_STEPS})"
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per worker")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default: the workload's for SGD, 1e-3 for Adam)",
    )
    p.add_argument(
        "--lr-milestones",
        type=argtype(_milestones),
        default=(),
        metavar="STEPS",
        help="comma-separated steps after which the learning rate is multiplied by --lr-gamma "
        "(a step decay, torch's MultiStepLR); default: constant",
    )
    p.add_argument(
        "--lr-gamma",
        type=float,
        default=d.lr_gamma,
        help=f"the factor of each decay at --lr-milestones (default {d.lr_gamma:g})",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="what every mode trains with (gravac's modes wrap it): SGD with --momentum, or Adam",
    )
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
    p.add_argument(
        "--stop-at",
        type=float,
        default=None,
        help=f"stop each run once its metric meets this value at {STOP_HOLD} evaluations in a "
        "row (accuracy: at or above; perplexity: at or below); default: train every step",
    )
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    p.add_argument(
        "--compressor",
        default=None,
        choices=compressors.names(),
        help=f"the gravac modes' compressor, without --variant (default {d.compressor})",
    )
    p.add_argument(
        "--compressor-options",
        type=argtype(_json_object("--compressor-options")),
        default=None,
        help="JSON object of compressor options, without --variant (default none)",
    )
    p.add_argument(
        "--policy",
        default=None,
        choices=policies.names(),
        help=f"the gravac modes' scaling policy, without --variant (default {d.policy})",
    )
    p.add_argument(
        "--policy-options",
        type=argtype(_json_object("--policy-options")),
        default=None,
        help="""JSON object of policy options, e.g. '{"cf": 100}' for --policy fixed, """
        "without --variant (default none)",
    )
    p.add_argument(
        "--engine-options",
        type=argtype(_json_object("--engine-options")),
        default=None,
        help=f"JSON object of more optimizer options ({', '.join(modes.ENGINE_OPTIONS)}), "
        """e.g. '{"error_feedback": false}', without --variant (default none)""",
    )
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        type=argtype(parse_variant),
        default=None,
        metavar=VARIANT_SYNTAX,
        help="a gravac configuration, named LABEL in the outputs; repeat it to run each gravac "
        """mode once per variant, e.g. --variant 'cf100=topk:fixed{"cf": 100}' --variant """
        "topk:geometric (unlabelled: topk-geometric); a third part, :{JSON}, holds its "
        "--engine-options. Replaces --compressor, --policy and their options "
        f"(default: the one variant they make). Compressors {compressors.names()}, policies "
        f"{policies.names()}",
    )
    p.add_argument(
        "--seeds",
        type=argtype(parse_seeds),
        default=None,
        help="comma-separated seeds (0,1,2): every mode and variant runs once per seed, the "
        "table gives the median and range over them (default 0)",
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
        "--no-bucket-view",
        action="store_true",
        help="DDP modes: gradient_as_bucket_view=False (DDP copies each bucket's result into "
        "gradients of their own)",
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
        help="seconds one job (a mode, variant and seed, or the link test) may take",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write everything as JSON here (every run, with its per-step series)",
    )
    p.add_argument(
        "--csv", type=Path, default=None, help="also write one row per mode, variant and seed here"
    )
    p.add_argument(
        "--plots",
        type=argtype(_plots_dir),
        default=None,
        metavar="DIR",
        help="also draw the figures into DIR as PNG: the metric against time and against bytes "
        "sent, the CF gravac sent each step and its density (needs matplotlib)",
    )
    scoreboard_cli.add_arguments(p)
    p.set_defaults(func=functools.partial(_main, p))


def _pick(value: Any, quick: bool, quick_value: Any, default: Any) -> Any:
    """An option's value: as given, else ``--quick``'s, else the default."""
    if value is not None:
        return value
    return quick_value if quick else default


def _single_variant(args: argparse.Namespace) -> dict[str, Any]:
    """The single-variant options given; ``ValueError`` if ``--variant`` is given too."""
    given = {attr: getattr(args, attr) for _, attr in _SINGLE_VARIANT}
    given = {attr: value for attr, value in given.items() if value is not None}
    if args.variants and given:
        options = [option for option, attr in _SINGLE_VARIANT if attr in given]
        raise ValueError(
            f"{options[0]} applies only without --variant: write the compressor, the policy "
            f"and their options into each --variant ({VARIANT_SYNTAX})"
        )
    return given


def _check_outputs(*paths: Path | None) -> None:
    """Every output file's folder exists (before any worker trains: results written nowhere
    would be lost).

    Raises:
        ValueError: naming the path whose folder is missing.
    """
    for path in paths:
        if path is not None and not path.expanduser().resolve().parent.is_dir():
            raise ValueError(f"{path}: its folder {path.parent} does not exist")


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    scoreboard_cli.check_options(args, parser)
    q = args.quick
    layout = NodeLayout.of_options(
        workers=args.workers, nodes=args.nodes, ranks_per_node=args.ranks_per_node
    )
    cfg = CompareConfig(
        modes=_pick(args.modes, q, QUICK_MODES, DEFAULT_MODES),
        workload=_pick(args.workload, q, workloads.QUICK_WORKLOAD, workloads.DEFAULT_WORKLOAD),
        workers=layout.world_size,
        nodes=layout.nodes,
        steps=_pick(args.steps, q, QUICK_STEPS, DEFAULT_STEPS),
        batch_size=args.batch_size,
        lr=args.lr,
        lr_milestones=args.lr_milestones,
        lr_gamma=args.lr_gamma,
        optimizer=args.optimizer,
        momentum=args.momentum,
        eval_every=_pick(args.eval_every, q, QUICK_EVAL_EVERY, DEFAULT_EVAL_EVERY),
        timing_warmup=args.timing_warmup,
        target=args.target,
        stop_at=args.stop_at,
        threads=args.threads,
        theta_min=args.theta_min,
        theta_max=args.theta_max,
        overlap=not args.no_overlap,
        bucket_view=not args.no_bucket_view,
        powersgd_rank=args.powersgd_rank,
        powersgd_start=args.powersgd_start,
        bandwidth=args.bandwidth,
        delay=args.delay,
        link_test_mb=_pick(args.link_test_mb, q, QUICK_LINK_TEST_MB, DEFAULT_LINK_TEST_MB),
        timeout=args.timeout,
        **_single_variant(args),
    )
    _check_outputs(args.out, args.csv, args.report)
    if args.scoreboard:
        return scoreboard_cli.main(args, cfg)
    study = Study(cfg, tuple(args.variants or ()), args.seeds or ())
    try:
        summary = run_compare(study)
    except (CompareError, NetworkError) as exc:
        print(f"gravac compare: error: {exc}", file=sys.stderr)
        return 1
    table = format_table(summary)
    summary["table"] = table
    if args.out is not None:
        write_json(summary, args.out)
    if args.csv is not None:
        write_csv(summary, args.csv)
    if args.plots is not None:
        for path in plots.write_plots(summary, args.plots):
            print(f"gravac compare: wrote {path}", file=sys.stderr)
    print(table)
    return 0
