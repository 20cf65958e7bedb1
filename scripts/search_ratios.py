"""Each variant's time to target against the best static CF's, seed by seed (gravac.compare.ratios).

    python scripts/search_ratios.py vgg-1g.json vgg-1g-more-seeds.json resnet-1g.json ...

reads ``gravac compare --out`` JSON files of studies that ran static CFs (``fixed`` variants)
beside other variants, pools the files of one workload and link, and prints two markdown tables:
the median over seeds of each variant's time to target over the fastest static CF's of the same
seed, and the median bytes sent and final metric.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gravac.compare.ratios import markdown, ratios, totals_markdown


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    rows = ratios([json.loads(Path(a).read_text()) for a in argv])
    print(markdown(rows))
    print(totals_markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
