"""The command line and commit a stored result keeps."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from gravac_lab.compare import provenance
from gravac_lab.compare.provenance import command_line, source_commit

ROOT = Path(__file__).resolve().parents[3]


def test_the_command_line_splits_back_into_its_arguments() -> None:
    argv = ["compare", "--scoreboard", "--variant", 'trial=topk:exponential{"search": "trial"}']
    line = command_line(argv)
    assert line.startswith("gravac compare --scoreboard ")
    assert shlex.split(line) == ["gravac", *argv]


@pytest.mark.slow  # git runs in a process of its own
def test_the_commit_is_the_checkout_s_head() -> None:
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    commit = source_commit()
    assert commit is not None
    assert commit in (head, head + "+changes")


@pytest.mark.slow
def test_outside_a_checkout_the_commit_is_unknown(tmp_path: Path) -> None:
    copy = tmp_path / "provenance_copy.py"
    shutil.copy(provenance.__file__, copy)
    spec = importlib.util.spec_from_file_location("provenance_copy", copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.source_commit() is None
