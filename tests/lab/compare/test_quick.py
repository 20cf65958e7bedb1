"""``gravac compare --quick`` end to end: real worker processes, real gloo, on loopback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from gravac_lab.compare import runner, workloads
from tests.background import Background, one_launch, succeeded
from tests.helpers import run_compare

pytestmark = pytest.mark.slow

MODES = ["ddp", "ddp-fp16", "gravac"]
#: gravac's Top-k at CF 100 sends values and int32 indices of 1% of each matrix, and the
#: biases dense: well under a tenth of the float32 bytes
GRAVAC_MAX_SHARE = 0.1
MODE_KEYS = {
    "mode",
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
    "parameters",
    "final_metric",
    "target",
    "time_to_target_seconds",
    "steps_to_target",
    "evaluations",
    "options",
    "variant",
    "seed",
    "ranks_agree",
    "wire_bytes_by_step",
    "cf_sent_by_step",
    "cf_achieved_by_step",
}


def _quick(out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    done = run_compare(
        "--quick", "--modes", ",".join(MODES), "--policy", "fixed",
        "--policy-options", '{"cf": 100}', "--out", str(out),
    )  # fmt: skip
    return done, out


#: the module's one run (tests/background.py starts it with the session)
launches = one_launch("quick", _quick, "quick.json")


@pytest.fixture(scope="module")
def quick(background: Background, request: pytest.FixtureRequest) -> tuple[dict[str, Any], str]:
    done, out = succeeded(background, request, "quick")
    return json.loads(out.read_text()), done.stdout


def test_quick_json_has_every_mode_and_field(quick: tuple[dict[str, Any], str]) -> None:
    summary, _ = quick
    assert [m["mode"] for m in summary["runs"]] == MODES
    for m in summary["runs"]:
        assert set(m) >= MODE_KEYS, f"{m['mode']}: missing {sorted(MODE_KEYS - set(m))}"
    assert summary["workload"]["name"] == workloads.QUICK_WORKLOAD
    assert summary["config"]["workers"] == 2
    assert summary["network"]["shaped"] is False
    assert "loopback" in summary["network"]["description"]
    assert summary["table"].count("\n| ") == len(MODES) + 1  # header and one row a mode
    assert summary["host"]["cpu"] == runner.cpu_name()
    assert summary["host"]["torch_cpu"] == torch.backends.cpu.get_cpu_capability()


def test_quick_values_are_sane(quick: tuple[dict[str, Any], str]) -> None:
    summary, _ = quick
    steps = summary["config"]["steps"]
    params = workloads.parameter_count(workloads.get(workloads.QUICK_WORKLOAD).model())
    for m in summary["runs"]:
        assert m["steps"] == steps
        assert m["parameters"] == params
        assert m["dense_wire_bytes_per_step"] == 4 * params
        assert 0.0 <= m["final_metric"] <= 1.0
        assert [e[0] for e in m["evaluations"]] == list(range(10, steps + 1, 10))
        assert 0.0 < m["compute_seconds"] < m["step_seconds"] * 10
        assert m["comm_seconds"] is not None and m["comm_seconds"] >= 0.0
    by_mode = {m["mode"]: m for m in summary["runs"]}
    assert by_mode["ddp"]["comm_source"] == "exposed"
    assert by_mode["gravac"]["comm_source"] == "record"
    assert by_mode["gravac"]["compress_seconds"] > 0.0
    # the single variant of --policy fixed --policy-options '{"cf": 100}', on every rank
    assert by_mode["gravac"]["variant"] == "topk-fixed-cf100"
    assert by_mode["gravac"]["cf_sent_by_step"] == [100.0] * steps
    assert by_mode["gravac"]["ranks_agree"] is True
    assert by_mode["ddp"]["cf_sent_by_step"] == [None] * steps


def test_quick_wire_bytes(quick: tuple[dict[str, Any], str]) -> None:
    summary, _ = quick
    by_mode = {m["mode"]: m for m in summary["runs"]}
    fp32 = by_mode["ddp"]["wire_bytes"]
    assert fp32 == summary["config"]["steps"] * by_mode["ddp"]["dense_wire_bytes_per_step"]
    assert by_mode["ddp-fp16"]["wire_bytes"] * 2 == fp32
    assert 0 < by_mode["gravac"]["wire_bytes"] < GRAVAC_MAX_SHARE * fp32


def test_quick_prints_the_table(quick: tuple[dict[str, Any], str]) -> None:
    summary, stdout = quick
    assert stdout.strip() == summary["table"]
    assert "loopback (not shaped)" in stdout
    for mode in ("ddp", "ddp-fp16"):
        assert f"| {mode} | – |" in stdout
    assert "| gravac | topk-fixed-cf100 |" in stdout
