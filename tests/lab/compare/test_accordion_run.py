"""Accordion in ``gravac compare``'s quick loopback mode: both gravac front ends, real worker
processes and gloo (the CI smoke test of the comparison's Accordion baseline)."""

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
LOW_CF = 1 / 0.99  # the default, Top-k keeping 99%
HIGH_CF = 10.0


def test_accordion_runs_in_both_gravac_modes_alike(tmp_path: Path) -> None:
    out = tmp_path / "accordion.json"
    variant = f'topk:accordion{{"interval": {INTERVAL}}}'
    argv = ["compare", "--quick", "--modes", "gravac,gravac-ddp", "--steps", str(STEPS),
            "--variant", variant, "--out", str(out)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["mode"] for r in runs] == ["gravac", "gravac-ddp"]
    for r in runs:
        assert r["variant"] == f"topk-accordion-interval{INTERVAL}" and r["ranks_agree"]
        cfs = r["cf_sent_by_step"]
        assert len(cfs) == STEPS
        assert all(cf == pytest.approx(LOW_CF, rel=1e-3) for cf in cfs[: 2 * INTERVAL])
        assert all(LOW_CF * 0.999 <= cf <= HIGH_CF * 1.001 for cf in cfs)
    assert runs[0]["cf_sent_by_step"] == runs[1]["cf_sent_by_step"]  # the same decisions
