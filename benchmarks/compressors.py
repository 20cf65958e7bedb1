"""Run ``gravac bench`` from a checkout: ``python benchmarks/compressors.py compressors --size 1M``.

The same command line as ``gravac bench ...`` (see benchmarks/README.md); all the code is in
:mod:`gravac_lab.bench`.
"""

from __future__ import annotations

import sys

from gravac.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
