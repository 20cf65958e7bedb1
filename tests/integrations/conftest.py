"""``example_runs``: each integration example on 2 processes, the selected ones side by side."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import torchrun_command
from tests.integrations._run import EXAMPLES, STEPS, Command, Run, run_examples


@pytest.fixture(scope="package")
def example_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    """By framework ("lightning", "hf"): the example's run, for each whose test module has a
    selected test that uses this fixture (a framework not installed skips its module)."""
    selected = {
        item.path.stem.removeprefix("test_")
        for item in request.session.items
        if "example_runs" in getattr(item, "fixturenames", ())
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
        # Lightning starts the second process itself
        "lightning": (lightning_command, lightning, {}),
        # nothing here downloads; make sure of it
        "hf": (hf_command, hf, {"HF_HUB_OFFLINE": "1"}),
    }
    return run_examples({k: v for k, v in commands.items() if k in selected})
