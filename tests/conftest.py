"""Tests in two speeds: every test that launches a process is marked ``slow``.

``make check`` runs ``pytest -m "not slow"`` (no process launches, the edit loop); ``make test``
runs everything. A process launch (a ``multiprocessing`` process, spawned workers or a pool
included, or any ``subprocess``: torchrun, ``python -m gravac``, ``ip``) in a test not marked
``slow`` raises :class:`UnmarkedLaunch`, in both speeds, so the fast subset stays fast.

The launches made are counted per test; the count is printed at the end of the run (with
``-v``, per test; "outside any test" is ``tests/lab/compare/namespaces.py``'s probe for network
namespaces at import).

``gloo_pools``: the session's pools of spawned gloo groups (:mod:`tests.workers`), one per world
size, that run the multi-process scenarios without a spawn each. ``background``: the launches
that modules name to start with the session, beside the tests run in this process
(:mod:`tests.background`).
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests import background as _background
from tests.workers import Workers


class UnmarkedLaunch(RuntimeError):
    """A test not marked ``slow`` launched a process."""


_current: pytest.Item | None = None
#: process launches by test node id ("" outside any test: collection, session start)
_launches: Counter[str] = Counter()
_originals: dict[str, Callable[..., Any]] = {}


def _launching(kind: str) -> None:
    label = getattr(_background.owner, "label", None)
    if label is not None:  # started for a module with selected slow tests, whatever runs now
        _launches[label] += 1
        return
    item = _current
    if item is not None and item.get_closest_marker("slow") is None:
        raise UnmarkedLaunch(
            f"{item.nodeid} launches a process ({kind}) but is not marked slow: mark it "
            "@pytest.mark.slow (make test runs it, make check leaves it out), or keep it "
            "in this process"
        )
    _launches[item.nodeid if item is not None else ""] += 1


def _process_start(self: multiprocessing.process.BaseProcess) -> None:
    _launching(f"multiprocessing {self.name}")
    _originals["process"](self)


def _execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
    _launching(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))}")
    _originals["popen"](self, args, *rest, **kw)


#: torch's intra-op threads in the pytest process. The tests' tensors are small, and the
#: launches beside them (tests/background.py, other slow tests' workers) keep the cores busy:
#: a second thread waiting for a core slowed the in-process tests down about twice
#: (tests/compressors: 53 s with 2 threads, 27 s with 1, on the 2-core machine). Spawned and
#: launched processes set their own (tests/workers.py, torchrun, gravac compare).
THREADS = 1


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(THREADS)
    _originals["process"] = multiprocessing.process.BaseProcess.start
    _originals["popen"] = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    multiprocessing.process.BaseProcess.start = _process_start  # type: ignore[method-assign]
    subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]


_BACKGROUND = pytest.StashKey[_background.Background]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the launches of every module that names them (``launches``) and has a selected
    test marked ``slow``, in the order of the run."""
    by_module: dict[Any, list[pytest.Item]] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "launches"):
            by_module.setdefault(module, []).append(item)
    for module, items in by_module.items():
        if any(i.get_closest_marker("slow") is not None for i in items):
            _background_of(session.config).start(module, items)


def _background_of(config: pytest.Config) -> _background.Background:
    if _BACKGROUND not in config.stash:
        config.stash[_BACKGROUND] = _background.Background()
    return config.stash[_BACKGROUND]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _BACKGROUND in config.stash:
        config.stash[_BACKGROUND].close()
    if _originals:
        multiprocessing.process.BaseProcess.start = _originals.pop("process")  # type: ignore[method-assign]
        subprocess.Popen._execute_child = _originals.pop("popen")  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _current
    _current = item
    try:
        return (yield)
    finally:
        _current = None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    total = sum(_launches.values())
    tests = len([k for k in _launches if k])
    terminalreporter.write_line(f"process launches: {total} (by {tests} tests)")
    if terminalreporter.config.getoption("verbose") > 0:
        for nodeid, n in _launches.most_common():
            terminalreporter.write_line(f"  {n:3d}  {nodeid or '(outside any test)'}")


@pytest.fixture(scope="session")
def gloo_pools() -> Iterator[Workers]:
    """Spawned gloo groups shared by the session's multi-process scenarios (tests.workers)."""
    pools = Workers()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture(scope="session")
def background(request: pytest.FixtureRequest) -> _background.Background:
    """The session's background launches (tests.background)."""
    return _background_of(request.config)
