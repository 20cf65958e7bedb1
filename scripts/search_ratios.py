"""Each variant's time to target against the best static CF's, seed by seed
(gravac_lab.compare.ratios).

    python scripts/search_ratios.py [--hold K] [--same A=B ...] vgg-1g.json more.json ...

reads ``gravac compare --out`` JSON files of studies that ran static CFs (``fixed`` variants)
beside other variants, pools the files of one workload and link, and prints two markdown tables:
the median over seeds of each variant's time to target over the fastest static CF's of the same
seed, and the median bytes sent and final metric. With ``--hold K`` a run reaches the target at
the first evaluation from which K evaluations in a row meet it. ``--same A=B`` counts variant
A's runs as B's (one configuration under two labels in files from different days).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from gravac_lab.compare.ratios import markdown, ratios, totals_markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="gravac compare --out JSON files")
    parser.add_argument(
        "--hold",
        type=int,
        default=1,
        help="evaluations in a row that must meet the target (default 1: the first that does)",
    )
    parser.add_argument(
        "--same",
        action="append",
        default=[],
        metavar="A=B",
        help="count variant A's runs as variant B's (repeatable)",
    )
    args = parser.parse_args(argv)
    same = dict(pair.split("=", 1) for pair in args.same if "=" in pair)
    if len(same) != len(args.same):
        parser.error(f"--same takes A=B, got {args.same}")
    rows = ratios([json.loads(f.read_text()) for f in args.files], hold=args.hold)
    rows = [dataclasses.replace(r, variant=same.get(r.variant, r.variant)) for r in rows]
    print(markdown(rows))
    if args.hold > 1:
        print(f"The target counts as reached where {args.hold} evaluations in a row meet it.\n")
    print(totals_markdown(rows))


if __name__ == "__main__":
    main()
