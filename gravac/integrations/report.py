"""What an integration example reports at the end of a run (shared by the examples).

Each rank writes its figures to ``<report_dir>/rank<r>.json`` (the tests compare the ranks'
parameter digests), and rank 0 prints the test accuracy, the CF and the bytes sent.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import nn

from gravac.engine import Engine

__all__ = ["digest", "report_run"]


def digest(model: nn.Module) -> str:
    """A hash of the parameters' bytes (equal on every rank when the ranks agree)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def report_run(
    engine: Engine,
    model: nn.Module,
    *,
    rank: int,
    world_size: int,
    accuracy: float,
    report_dir: Path | None,
) -> None:
    """Write this rank's figures under ``report_dir`` (if given); print them on rank 0."""
    last = engine.last_record
    wire, dense = engine.total_wire_bytes, engine.total_dense_wire_bytes
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        report = {
            "rank": rank,
            "world_size": world_size,
            "steps": engine.steps,
            "cf_sent": last.cf_sent if last is not None else None,
            "wire_bytes": wire,
            "dense_wire_bytes": dense,
            "accuracy": accuracy,
            "digest": digest(model),
        }
        (report_dir / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        print(f"test accuracy {accuracy:.4f}")
        if last is not None:
            print(f"gravac steps {engine.steps}, CF sent at the last step {last.cf_sent:g}")
        print(f"wire bytes {wire:,} (dense fp32 {dense:,}, {dense / max(wire, 1):.1f}x)")
