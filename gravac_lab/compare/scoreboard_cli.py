"""``gravac compare --scoreboard``: its options, their checks, and the run or the rebuild.

:func:`add_arguments` adds the scoreboard's own options to ``gravac compare``'s parser;
:func:`check_options` rejects, before anything runs, a scoreboard option given without
``--scoreboard``, a ``compare`` option the scoreboard replaces (its setups name the workloads and
links, its ladder and searches the variants, its bar the target), and with ``--from-json`` any
option of training. :func:`main` plans and runs the studies
(:mod:`gravac_lab.compare.scoreboard_plan`), writing the JSON after each when ``--out`` is given,
and prints the table (:mod:`gravac_lab.compare.scoreboard_table`); with ``--from-json`` it only
rebuilds the tables from those JSONs. With ``--report`` it also writes the results page
(:mod:`gravac_lab.compare.results_page`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gravac.argtypes import argtype
from gravac_lab.compare import plots
from gravac_lab.compare.config import DEFAULT_STEPS, CompareConfig
from gravac_lab.compare.export import write_json
from gravac_lab.compare.netns import NetworkError
from gravac_lab.compare.provenance import command_line, source_commit
from gravac_lab.compare.results_page import PLOTS, write_page
from gravac_lab.compare.runner import CompareError
from gravac_lab.compare.scoreboard import LADDER
from gravac_lab.compare.scoreboard_plan import (
    DEFAULT_SEARCHES,
    DEFAULT_SETUPS,
    DEFAULT_TIMING_STEPS,
    SEEDS,
    Inputs,
    parse_ladder,
    parse_setups,
    plan,
    run_plan,
    settings,
)
from gravac_lab.compare.scoreboard_table import format_scoreboard
from gravac_lab.compare.study import parse_variant

__all__ = ["add_arguments", "check_options", "main"]

#: the options only ``--scoreboard`` takes: (option, attribute)
_SCOREBOARD_ONLY = (
    ("--setups", "setups"),
    ("--ladder", "ladder"),
    ("--timing-steps", "timing_steps"),
    ("--from-json", "from_json"),
    ("--baselines", "baselines"),
    ("--twins", "twins"),
    ("--report", "report"),
)
#: ``gravac compare``'s options that the scoreboard replaces: (option, attribute)
_REPLACED = (
    ("--quick", "quick"),
    ("--modes", "modes"),
    ("--workload", "workload"),
    ("--bandwidth", "bandwidth"),
    ("--target", "target"),
    ("--compressor", "compressor"),
    ("--compressor-options", "compressor_options"),
    ("--policy", "policy"),
    ("--policy-options", "policy_options"),
    ("--engine-options", "engine_options"),
    ("--powersgd-rank", "powersgd_rank"),
    ("--powersgd-start", "powersgd_start"),
    ("--csv", "csv"),
    ("--plots", "plots"),
)
#: the options of a scoreboard's training, which ``--from-json`` does not train
_TRAINING = (
    ("--setups", "setups"),
    ("--ladder", "ladder"),
    ("--timing-steps", "timing_steps"),
    ("--baselines", "baselines"),
    ("--twins", "twins"),
    ("--variant", "variants"),
    ("--seeds", "seeds"),
    ("--workers", "workers"),
    ("--nodes", "nodes"),
    ("--ranks-per-node", "ranks_per_node"),
    ("--steps", "steps"),
    ("--batch-size", "batch_size"),
    ("--lr", "lr"),
    ("--lr-milestones", "lr_milestones"),
    ("--lr-gamma", "lr_gamma"),
    ("--momentum", "momentum"),
    ("--eval-every", "eval_every"),
    ("--timing-warmup", "timing_warmup"),
    ("--threads", "threads"),
    ("--theta-min", "theta_min"),
    ("--theta-max", "theta_max"),
    ("--no-overlap", "no_overlap"),
    ("--no-bucket-view", "no_bucket_view"),
    ("--delay", "delay"),
    ("--link-test-mb", "link_test_mb"),
    ("--timeout", "timeout"),
    ("--out", "out"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--scoreboard`` and the options only it takes to ``gravac compare``'s parser."""
    g = p.add_argument_group(
        "scoreboard",
        "--scoreboard judges the searches against the static CFs that reach dense DDP's quality "
        "(docs/controller.md, 'The scoreboard')",
    )
    g.add_argument(
        "--scoreboard",
        action="store_true",
        help="train dense DDP, the static ladder and the searches (--variant; default "
        f"{', '.join(DEFAULT_SEARCHES)}) on every setup, seeds {','.join(map(str, SEEDS))} "
        "unless --seeds, and print each setup's bar, yardstick and ratios; --steps is dense's "
        f"budget (default {DEFAULT_STEPS})",
    )
    g.add_argument(
        "--setups",
        type=argtype(parse_setups),
        default=None,
        help="comma-separated WORKLOAD@LINK, LINK loopback or a tc rate (shaped links need "
        f"root) (default {','.join(DEFAULT_SETUPS)})",
    )
    g.add_argument(
        "--ladder",
        type=argtype(parse_ladder),
        default=None,
        help=f"comma-separated static Top-k CFs (default {','.join(f'{c:g}' for c in LADDER)})",
    )
    g.add_argument(
        "--timing-steps",
        type=int,
        default=None,
        help="steps of the run that times dense DDP and each static CF on a shaped link "
        f"(default {DEFAULT_TIMING_STEPS})",
    )
    g.add_argument(
        "--baselines",
        action="store_true",
        help="also train DDP with PyTorch's fp16 hook and Accordion as the GraVAC paper ran it "
        "(PowerSGD, ranks 4 and 1), and set the default search against them",
    )
    g.add_argument(
        "--twins",
        action="store_true",
        help="also train every static CF again drawing other batches (same initial weights): "
        "what a search as good as a CF scores by luck alone, and the chance that one as good "
        "as the yardstick meets the bound",
    )
    g.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        metavar="PATH",
        help="print the table of each scoreboard's --out JSON given, without training",
    )
    g.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="PAGE",
        help="also write the results page (markdown) at PAGE from the scoreboard trained or "
        f"the --from-json ones, its figures under {PLOTS}/ beside it (needs matplotlib)",
    )


def _given(
    args: argparse.Namespace, parser: argparse.ArgumentParser, options: tuple[tuple[str, str], ...]
) -> list[str]:
    """The ``options`` whose value in ``args`` is not their default."""
    return [o for o, attr in options if getattr(args, attr) != parser.get_default(attr)]


def check_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Reject options that do not go together (see the module docstring).

    Raises:
        ValueError: naming the option and what it needs.
    """
    if not args.scoreboard:
        given = _given(args, parser, _SCOREBOARD_ONLY)
        if given:
            raise ValueError(f"{given[0]} applies only with --scoreboard")
        return
    replaced = _given(args, parser, _REPLACED)
    if replaced:
        raise ValueError(
            f"{replaced[0]} does not apply with --scoreboard: --setups names the workloads and "
            "links, --ladder and --variant the static CFs and searches, and dense DDP sets the "
            "bar"
        )
    if args.from_json is not None:
        training = _given(args, parser, _TRAINING)
        if training:
            raise ValueError(
                f"{training[0]} does not apply with --from-json, which rebuilds the table "
                "without training"
            )


def _load(path: Path) -> dict[str, Any]:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--from-json {str(path)!r}: cannot read a scoreboard's JSON: {exc}"
        ) from None
    if not isinstance(stored, dict) or "scoreboard" not in stored or "studies" not in stored:
        raise ValueError(
            f"--from-json {str(path)!r} is not a scoreboard's JSON (gravac compare --scoreboard "
            "--out)"
        )
    return stored


def _report(stored: list[dict[str, Any]], page: Path | None) -> None:
    """Write the results page at ``page`` from ``stored``, where asked, naming its files."""
    if page is None:
        return
    for path in write_page(stored, page):
        print(f"gravac compare: wrote {path}", file=sys.stderr)


def main(args: argparse.Namespace, base: CompareConfig) -> int:
    """Run the scoreboard with ``base`` (the shared options, ``steps`` dense's budget), or
    rebuild its table (``--from-json``); the exit status."""
    if args.report is not None:
        plots.check_available()  # before anything is read or trains
    if args.from_json is not None:
        boards = [_load(path) for path in args.from_json]
        print("\n\n".join(format_scoreboard(b) for b in boards))
        _report(boards, args.report)
        return 0
    setups = args.setups or parse_setups(",".join(DEFAULT_SETUPS))
    ladder = args.ladder or LADDER
    searches = tuple(args.variants or (parse_variant(s) for s in DEFAULT_SEARCHES))
    seeds = args.seeds or SEEDS
    timing_steps = DEFAULT_TIMING_STEPS if args.timing_steps is None else args.timing_steps
    inputs = Inputs(base, setups, ladder, searches, seeds, timing_steps, args.baselines, args.twins)
    planned = plan(inputs)
    header = {
        **settings(inputs),
        "command": command_line(args.argv),
        "commit": source_commit(),
    }
    out: Path | None = args.out

    def store(entries: list[dict[str, Any]]) -> None:
        if out is not None:
            write_json({"scoreboard": header, "studies": entries}, out)

    try:
        entries = run_plan(planned, store)
    except (CompareError, NetworkError) as exc:
        print(f"gravac compare: error: {exc}", file=sys.stderr)
        return 1
    stored: dict[str, Any] = {"scoreboard": header, "studies": entries}
    table = format_scoreboard(stored)
    if out is not None:
        write_json({**stored, "table": table}, out)
    print(table)
    _report([stored], args.report)
    return 0
