"""Accordion in ``gravac compare``'s quick loopback mode: real worker processes and gloo (the
CI smoke test of the comparison's Accordion baseline)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from gravac.cli import main

pytestmark = pytest.mark.slow

#: steps between Accordion's decisions: the first two intervals send every layer at low_cf
INTERVAL = 3
STEPS = 18
LOW_CF = 1.0  # the default, Top-k keeping 99%: below its break-even, so sent dense
HIGH_CF = 10.0


def test_accordion_runs_in_the_comparison(tmp_path: Path) -> None:
    """Through the DDP hook (``gravac-ddp``); that both front ends decide alike, on every rank,
    tests/control/searches/test_accordion.py checks on a pool of gloo workers."""
    out = tmp_path / "accordion.json"
    variant = f'topk:accordion{{"interval": {INTERVAL}}}'
    argv = ["compare", "--quick", "--modes", "gravac-ddp", "--steps", str(STEPS),
            "--variant", variant, "--out", str(out)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["mode"] == "gravac-ddp"
    assert run["variant"] == f"topk-accordion-interval{INTERVAL}" and run["ranks_agree"]
    cfs = run["cf_sent_by_step"]
    assert len(cfs) == STEPS
    assert all(cf == pytest.approx(LOW_CF, rel=1e-3) for cf in cfs[: 2 * INTERVAL])
    assert all(LOW_CF * 0.999 <= cf <= HIGH_CF * 1.001 for cf in cfs)
