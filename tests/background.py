"""Launches started at the session's start, beside the tests that run in this process.

Most of the suite runs in the pytest process, on one core, while the tests that launch
processes (torchrun, an example that starts its own workers) wait on them, their start mostly
in one process too. A test module whose launches do not depend on the tests before it may
name them: a module-level ``launches(tmp, items)`` returns ``{name: make}``, each ``make()``
one launch (it returns what the tests read; it must not raise on a failed run), given a
fresh directory ``tmp`` and the module's selected tests ``items``. When a selected test of
that module is marked ``slow`` (``make check`` starts nothing), ``tests/conftest.py`` hands
them to the session's :class:`Background` as soon as collection ends; they run
:data:`CONCURRENT` at a time, in the order of the modules in the run, and the module's
fixture reads them with :meth:`Background.results`, waiting for those still running.

A launch made here counts for the module (``background: <module>`` in the launch counts),
not for the test that happens to run in this process meanwhile.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

#: launches at once: each keeps about one core busy (an agent or a parent waits while two
#: workers start), beside the tests in this process
CONCURRENT = 2

#: the module a background thread launches for (``None`` outside its launches)
owner = threading.local()


class Background:
    """The session's background launches, by module."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(CONCURRENT, thread_name_prefix="background-launch")
        self._tmp = Path(tempfile.mkdtemp(prefix="gravac-tests-"))
        self._futures: dict[str, dict[str, Future[Any]]] = {}

    def start(self, module: ModuleType, items: list[pytest.Item]) -> None:
        """Start ``module``'s launches for its selected ``items`` (once)."""
        if module.__name__ in self._futures:
            return
        tmp = self._tmp / module.__name__
        tmp.mkdir()
        label = f"background: {module.__name__}"

        def run(make: Callable[[], Any]) -> Any:
            owner.label = label
            try:
                return make()
            finally:
                owner.label = None

        makes: dict[str, Callable[[], Any]] = module.launches(tmp, items)
        self._futures[module.__name__] = {
            name: self._pool.submit(run, make) for name, make in makes.items()
        }

    def results(self, request: pytest.FixtureRequest) -> dict[str, Any]:
        """The launches of the requesting test's module, by name, once all have ended (they
        start now if they were not started with the session)."""
        module = request.module
        items = [i for i in request.session.items if i.path == request.path]
        self.start(module, items)
        return {name: f.result() for name, f in self._futures[module.__name__].items()}

    def close(self) -> None:
        """Drop the launches not started, wait for the running ones, remove their files."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self._tmp, ignore_errors=True)


#: a module's ``launches`` (the module docstring)
Launches = Callable[[Path, list[pytest.Item]], dict[str, Callable[[], Any]]]
#: what a launch of a command returns: the finished process and the file or folder it wrote
Finished = tuple[subprocess.CompletedProcess[str], Path]


def one_launch(name: str, run: Callable[[Path], Finished], path: str) -> Launches:
    """The ``launches`` of a module whose tests read one run: ``run(tmp / path)``, named
    ``name``."""

    def launches(tmp: Path, items: list[pytest.Item]) -> dict[str, Callable[[], Any]]:
        return {name: functools.partial(run, tmp / path)}

    return launches


def succeeded(background: Background, request: pytest.FixtureRequest, name: str) -> Finished:
    """The requesting module's launch ``name`` (:data:`Finished`) once it has ended; the test
    fails with the end of the process's stderr unless it exited 0."""
    done, path = background.results(request)[name]
    assert done.returncode == 0, done.stderr[-3000:]
    return done, path
