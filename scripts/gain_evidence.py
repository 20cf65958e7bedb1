"""Which compression gain predicts time to accuracy (gravac_lab.compare.evidence), from studies.

    python scripts/gain_evidence.py docs/results/gain-evidence vgg.json lstm.json resnet.json

reads ``gravac compare --out`` JSON files of studies that ran static CFs with
``measure=True`` beside DDP, and writes ``evidence.md`` (the table) and ``evidence.png`` (both
gains against the progress per step) into the directory given first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gravac_lab.compare.evidence import evidence, markdown, write_evidence_plot


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    out, files = Path(argv[0]), [Path(a) for a in argv[1:]]
    rows = evidence([json.loads(f.read_text()) for f in files])
    out.mkdir(parents=True, exist_ok=True)
    (out / "evidence.md").write_text(markdown(rows))
    write_evidence_plot(rows, out / "evidence.png")
    print(markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
