"""The integration examples on 2 real DDP (gloo) processes: Lightning's, which starts its
second process itself, and the Hugging Face Trainer's under torchrun.

Both runs are made once, side by side, by the module fixture ``example_runs`` (each spends
much of its run in one process: importing the framework, a launcher waiting); a framework
that is not installed skips its test and is not launched.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import torchrun_command
from tests.integrations._run import (
    EXAMPLES,
    STEPS,
    Command,
    Run,
    assert_compressed,
    read_reports,
    run_examples,
)

pytestmark = pytest.mark.slow

#: by example: the module whose absence skips it
FRAMEWORKS = {"lightning": "lightning.pytorch", "hf": "transformers"}


def _installed(example: str) -> bool:
    module = FRAMEWORKS[example]
    return importlib.util.find_spec(module.split(".")[0]) is not None


@pytest.fixture(scope="module")
def example_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    """By example ("lightning", "hf"): its run, for each installed one that a selected test
    of this module reads."""
    selected = {
        item.callspec.params["example"]
        for item in request.session.items
        if item.path == request.path and hasattr(item, "callspec")
    }
    tmp = tmp_path_factory.mktemp("examples")
    lightning, hf = tmp / "lightning", tmp / "hf"

    def lightning_command() -> list[str]:
        script = EXAMPLES / "lightning_ddp.py"
        return [sys.executable, str(script), f"--max-steps={STEPS}", f"--report={lightning}"]

    def hf_command() -> list[str]:
        return torchrun_command(
            EXAMPLES / "hf_trainer.py",
            f"--max-steps={STEPS}",
            f"--output-dir={hf / 'out'}",
            f"--report={hf}",
        )

    commands: dict[str, tuple[Command, Path, dict[str, str]]] = {
        "lightning": (lightning_command, lightning, {}),
        "hf": (hf_command, hf, {"HF_HUB_OFFLINE": "1"}),  # nothing here downloads
    }
    return run_examples({k: v for k, v in commands.items() if k in selected and _installed(k)})


@pytest.mark.parametrize("example", ["lightning", "hf"])
def test_the_example_compresses_on_two_processes(
    example_runs: dict[str, Run], example: str
) -> None:
    if not _installed(example):
        pytest.skip(f"needs {FRAMEWORKS[example]}")
    assert_compressed(read_reports(example_runs[example]))
