"""``ddp-powersgd`` trains past its switch-over on gloo with the multi-bucket VGG workload.

torch's ``powerSGD_hook`` mis-orders gloo collectives across DDP buckets from
``start_powerSGD_iter`` on (see :mod:`gravac_lab.compare.modes`); the mode runs with one bucket.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from gravac_lab.compare import workloads
from tests.background import Background, one_launch, succeeded
from tests.helpers import run_compare

pytestmark = pytest.mark.slow

RANK = 4
START = 2
STEPS = 4


def _powersgd_elements(model: torch.nn.Module, rank: int) -> int:
    """Elements sent per step, by the rule torch's hook documents: a matrix n x m (a weight
    viewed as ``shape[0] x rest``) travels as rank-r factors when ``(n + m) r * 2 < n m``
    (``min_compression_rate`` 2), else whole; vectors travel whole."""
    total = 0
    for p in model.parameters():
        if p.dim() < 2:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return total


def _run(out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    done = run_compare(
        "--workload", "vgg-digits", "--modes", "ddp-powersgd", "--steps", str(STEPS),
        "--powersgd-start", str(START), "--powersgd-rank", str(RANK), "--timing-warmup", "1",
        "--eval-every", str(STEPS), "--out", str(out),
    )  # fmt: skip
    return done, out


#: the module's one run (tests/background.py starts it with the session)
launches = one_launch("powersgd", _run, "powersgd.json")


@pytest.fixture(scope="module")
def run(background: Background, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The run's one mode's record, once it has ended."""
    _, out = succeeded(background, request, "powersgd")
    (m,) = json.loads(out.read_text())["runs"]
    return m


def test_ddp_powersgd_runs_past_the_switch_over(run: dict[str, Any]) -> None:
    model = workloads.get("vgg-digits").model()
    dense = workloads.parameter_count(model)
    compressed = _powersgd_elements(model, RANK)
    assert run["wire_bytes"] == 4 * (START * dense + (STEPS - START) * compressed)
    assert run["wire_bytes_per_step"] == 4 * compressed
    assert run["timed_from"] == START + 1
    assert "bucket_cap_mb" in run["options"]
