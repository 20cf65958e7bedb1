"""A study's files: its whole summary as JSON, and one CSV row a run.

:func:`write_json` writes everything :func:`gravac_lab.compare.runner.run_compare` returned (and the
table, once the command line adds it): the configuration, the study's variants and seeds, every
run's :class:`gravac_lab.compare.report.ModeSummary` with its per-step series, and every mode and
variant over the seeds. :func:`write_csv` writes one row per mode, variant and seed: the
summary's figures (:data:`CSV_COLUMNS`), none of its lists or options, for a spreadsheet or
``pandas.read_csv``. An empty cell is a figure the run has not (a variant for a DDP mode, a
target not reached).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

__all__ = ["CSV_COLUMNS", "write_csv", "write_json"]

#: the CSV's columns, :class:`gravac_lab.compare.report.ModeSummary` fields: which run, then its
#: figures (seconds, bytes, the metric)
CSV_COLUMNS = (
    "mode",
    "variant",
    "seed",
    "steps",
    "timed_from",
    "step_seconds",
    "forward_backward_seconds",
    "compute_seconds",
    "compress_seconds",
    "comm_seconds",
    "comm_source",
    "other_seconds",
    "wire_bytes",
    "wire_bytes_per_step",
    "dense_wire_bytes_per_step",
    "internode_bytes",
    "internode_bytes_per_step",
    "parameters",
    "final_metric",
    "target",
    "time_to_target_seconds",
    "steps_to_target",
    "ranks_agree",
)


def write_json(summary: dict[str, Any], path: Path) -> None:
    """Write ``summary`` to ``path`` as indented JSON."""
    path.write_text(json.dumps(summary, indent=2) + "\n")


def write_csv(summary: dict[str, Any], path: Path) -> None:
    """Write one row per run of ``summary`` (``summary["runs"]``) to ``path``."""
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary["runs"])
