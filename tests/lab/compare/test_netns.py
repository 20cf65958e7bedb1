"""Shaped links between network namespaces: made, measured, and always removed (root only)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gravac.cli import main
from gravac_lab.compare import netns
from tests.helpers import alive
from tests.lab.compare.namespaces import UNAVAILABLE

RATE = "1gbit"
#: a link shaped to 1 Gbit/s must measure below this (an unshaped veth moves 10+ Gbit/s) ...
MAX_GBIT = 1.1
#: ... and above this, even on a busy 2-core machine
MIN_GBIT = 0.25
#: seconds to wait for a run's namespaces to appear, and for it to end after a signal
APPEAR_TIMEOUT = 60.0
END_TIMEOUT = 60.0
#: steps of a tiny run, and of one that runs until it is interrupted
STEPS = 4
ENDLESS = 10**6


def _tiny(steps: int = STEPS, link_test_mb: int = 8) -> list[str]:
    """A tiny shaped run: the demo's CNN in one mode, a link test of ``link_test_mb`` MiB (0:
    none)."""
    return ["compare", "--workload", "tiny-digits", "--modes", "ddp", "--steps", str(steps),
            "--timing-warmup", "1", "--eval-every", "2", "--bandwidth", RATE,
            "--link-test-mb", str(link_test_mb)]  # fmt: skip


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs shaped links: {UNAVAILABLE}"),
]


def _leftovers(pid: int | None = None) -> list[str]:
    return netns.list_namespaces(netns.prefix(pid))


def _pids_in(namespace: str) -> list[int]:
    """The processes inside ``namespace`` (none once it is gone)."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _workers_in(namespace: str) -> list[int]:
    """The workers inside ``namespace``: the processes its rank's fork server
    (:mod:`gravac_lab.compare.forkserver`, itself inside) forked."""
    pids = _pids_in(namespace)
    workers = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # it ended meanwhile
            continue
        ppid = next(line for line in status.splitlines() if line.startswith("PPid:"))
        if int(ppid.split()[1]) in pids:
            workers.append(pid)
    return workers


def _sigint_as_from_a_terminal() -> None:
    """In the run's process, before it starts: SIGINT's default action, as under a terminal.
    A shell's background job (a CI run started with ``&``) ignores SIGINT and its children
    inherit that, so Python would install no ``KeyboardInterrupt`` and ignore the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_shaped_run_measures_the_rate_and_removes_its_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "shaped.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([*_tiny(), "--out", str(out)]) == 0
    network = json.loads(out.read_text())["network"]
    assert network["shaped"] is True
    assert network["bandwidth"] == RATE
    assert MIN_GBIT < network["measured_gbit_per_s"] < MAX_GBIT
    assert "veth pair" in stdout.getvalue()
    assert _leftovers() == []


def test_failed_run_removes_its_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    # 1 s is too short for the workers to start: the link test fails after the links exist
    assert main([*_tiny(), "--timeout", "1"]) == 1
    assert "--timeout" in capsys.readouterr().err
    assert _leftovers() == []


def test_bridge_network_for_more_workers_is_made_and_removed() -> None:
    with netns.ShapedNetwork(3, netns.parse_rate(RATE)) as net:
        made = set(_leftovers())
        assert made == {net.namespace(r) for r in range(3)} | {net.bridge_namespace}
        qdisc = subprocess.run(
            ["tc", "-n", net.namespace(2), "qdisc", "show", "dev", net.ifname(2)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc
    assert _leftovers() == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_kills_its_workers_and_removes_its_namespaces(signum: int) -> None:
    proc = subprocess.Popen(  # no link test: its two workers would only cost time here
        [sys.executable, "-m", "gravac", *_tiny(ENDLESS, link_test_mb=0)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_sigint_as_from_a_terminal,
    )
    try:
        # interrupt once a training worker runs inside its namespace
        namespace = f"{netns.prefix(proc.pid)}n0"
        deadline = time.monotonic() + APPEAR_TIMEOUT
        while not (workers := _workers_in(namespace)):
            assert proc.poll() is None, "the run ended before starting its workers"
            assert time.monotonic() < deadline, "no worker started in the run's namespace"
            time.sleep(0.1)
        os.kill(proc.pid, signum)
        assert proc.wait(timeout=END_TIMEOUT) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _leftovers(proc.pid) == []
    assert not any(alive(pid) for pid in workers)


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_removal_deletes_only_the_namespaces_of_gone_owners_it_recorded() -> None:
    """A namespace recorded by a run that is gone is deleted with its record; one recorded by
    a live run, and one of a dead-looking pid that no run recorded (another tool's, or a
    process in another pid namespace), are left alone (before, any ``gvc<dead pid>-`` name was
    deleted)."""
    gone, foreign, live = (f"{netns.prefix(_dead_pid())}w0", f"{netns.prefix(_dead_pid())}w1",
                           f"{netns.prefix()}w0")  # fmt: skip
    netns.OWNERS.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        for name in (gone, foreign, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        (netns.OWNERS / gone).write_text(f"{gone[3:].split('-')[0]} 1\n")
        (netns.OWNERS / live).write_text(f"{netns._owner(os.getpid())}\n")
        assert netns.remove_stale() == [gone]
        assert not (netns.OWNERS / gone).exists() and (netns.OWNERS / live).exists()
        assert set(netns.list_namespaces()) >= {foreign, live}
        assert gone not in netns.list_namespaces()
    finally:
        for name in (gone, foreign, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            (netns.OWNERS / name).unlink(missing_ok=True)


def test_a_network_records_its_namespaces_and_forgets_them_when_removed() -> None:
    with netns.ShapedNetwork(2, netns.parse_rate(RATE)) as net:
        names = [net.namespace(0), net.namespace(1)]
        owner = netns._owner(os.getpid())
        assert all((netns.OWNERS / n).read_text().strip() == owner for n in names)
    assert not any((netns.OWNERS / n).exists() for n in names)
