"""The ``gravac`` command line (also ``python -m gravac``).

Each subcommand lives in its own module, which exposes ``add_parser(subparsers)``; that function
adds the subcommand's parser(s) and sets ``func`` on every leaf parser to a handler taking the
parsed :class:`argparse.Namespace` and returning the exit status. The runtime package's own
subcommand (``demo``) is listed in :data:`SUBCOMMANDS`; the lab's (``bench``, ``compare``, in the
sibling package :mod:`gravac_lab`) are entry points of the group :data:`ENTRY_POINT_GROUP`, so
that the runtime package never imports the lab.

Subcommands:
    demo                train a small CNN on digits with GraVAC across 2 gloo workers
    bench compressors   throughput, NMSE, achieved CF and wire bytes of every compressor
    bench multilevel    multi-level compression against compressing twice
    bench kernels       each CuPy kernel against its torch path and a plain copy (CUDA)
    compare             DDP, its compression hooks and gravac on the same run: step time and its
                        split, bytes sent, time to target accuracy (shaped links as root)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from gravac import __version__, demo

__all__ = ["ENTRY_POINT_GROUP", "SUBCOMMANDS", "build_parser", "main", "subcommands"]

AddParser = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

#: ``add_parser`` functions of the runtime package's subcommand modules
SUBCOMMANDS: tuple[AddParser, ...] = (demo.add_parser,)
#: the entry-point group whose entries are more ``add_parser`` functions (the lab's)
ENTRY_POINT_GROUP = "gravac.commands"


def subcommands() -> list[AddParser]:
    """Every ``add_parser``: :data:`SUBCOMMANDS`, then the entry points of
    :data:`ENTRY_POINT_GROUP` sorted by name (the order ``--help`` lists them)."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    return [*SUBCOMMANDS, *(ep.load() for ep in found)]


def build_parser() -> argparse.ArgumentParser:
    """The ``gravac`` argument parser with every subcommand of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="gravac",
        description="Adaptive gradient compression for distributed PyTorch training (GraVAC).",
    )
    parser.add_argument("--version", action="version", version=f"gravac {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in subcommands():
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Usage errors, including option values rejected with ``ValueError`` after parsing, exit
    through :class:`SystemExit` with status 2 and the message, as argparse does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for stored results
    try:
        return int(args.func(args))
    except ValueError as exc:  # bad option values found past argparse: a usage error
        parser.error(str(exc))
