"""The launch guard of tests/conftest.py: a test not marked slow cannot launch a process (so
``make check``, which leaves the slow tests out, launches none)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest


def test_a_test_not_marked_slow_cannot_launch_a_process() -> None:
    with pytest.raises(RuntimeError, match=r"launches a process \(subprocess .*not marked slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    process = multiprocessing.get_context("spawn").Process(target=print)
    with pytest.raises(RuntimeError, match=r"launches a process \(multiprocessing .*not marked"):
        process.start()
    assert process.pid is None  # refused before anything started
