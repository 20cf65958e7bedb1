"""The shadow window gain of the CF sent beside its real one (gravac_lab.compare.evidence).

    python scripts/shadow_evidence.py vgg-digits-1gbit.json lstm-text-1gbit.json ...

reads ``gravac compare --out`` JSON files of studies that ran the search by shadow
(``topk:exponential{"search": "shadow"}``) and prints, per run, how far the shadow window gain
of the CF it sent was from that CF's real window gain over the same windows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gravac_lab.compare.evidence import shadow_checks, shadow_markdown


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    print(shadow_markdown(shadow_checks([json.loads(Path(a).read_text()) for a in argv])))


if __name__ == "__main__":
    main(sys.argv[1:])
