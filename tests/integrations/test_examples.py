"""The integration examples on 2 real DDP (gloo) processes: Lightning's, which starts its
second process itself, and the Hugging Face Trainer's under torchrun.

Both runs are made once (``launches``: started with the session, beside the tests run in this
process, tests/background.py); a framework that is not installed skips its test and is not
launched.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.background import Background
from tests.helpers import torchrun_command
from tests.integrations._run import (
    EXAMPLES,
    STEPS,
    Command,
    Run,
    assert_compressed,
    read_reports,
    run_example,
)

pytestmark = pytest.mark.slow

#: by example: the module whose absence skips it
FRAMEWORKS = {"lightning": "lightning.pytorch", "hf": "transformers"}


def _installed(example: str) -> bool:
    module = FRAMEWORKS[example]
    return importlib.util.find_spec(module.split(".")[0]) is not None


def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Run]]:
    """By example ("lightning", "hf"): its run, for each installed one that a selected test
    reads (tests/background.py starts them with the session)."""
    selected = {i.callspec.params["example"] for i in items if hasattr(i, "callspec")}
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
    return {
        name: functools.partial(run_example, *spec)
        for name, spec in commands.items()
        if name in selected and _installed(name)
    }


@pytest.fixture(scope="module")
def example_runs(background: Background, request: pytest.FixtureRequest) -> dict[str, Run]:
    """The module's launches (``launches``), once all have ended."""
    return background.results(request)


@pytest.mark.parametrize("example", ["lightning", "hf"])
def test_the_example_compresses_on_two_processes(
    example_runs: dict[str, Run], example: str
) -> None:
    if not _installed(example):
        pytest.skip(f"needs {FRAMEWORKS[example]}")
    assert_compressed(read_reports(example_runs[example]))
