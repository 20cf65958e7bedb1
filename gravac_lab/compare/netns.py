"""Where the workers of ``gravac compare`` talk: loopback, or shaped links between namespaces.

With ``--bandwidth`` and root, every node (:mod:`gravac_lab.compare.layout`; without
``--nodes``, every worker) runs in its own network namespace behind a veth link shaped by
``tc``'s token bucket filter, in both directions, so that each node has a full-duplex link of
the given rate, as behind a NIC on a switch:

* 2 nodes: one veth pair between the two namespaces;
* N nodes: a veth pair from each node's namespace to a bridge in an extra namespace.

The workers of a node share its namespace, its link and its one address: their traffic to each
other goes to that address, which the kernel delivers over the namespace's loopback, unshaped
and off the link, as between the processes of one machine. :meth:`Network.tx_bytes` reads what
the nodes' links sent (each namespace's ``/sys/class/net/<link>/statistics/tx_bytes``), so that
the runner can report the bytes that crossed between nodes.

Nothing is created in the caller's namespace: every link is created inside the run's own
namespaces, and deleting those deletes the links with them. Every name carries the prefix
``gvc<pid>-`` (interfaces ``gvc<pid>n<node>``, ...), so parallel runs never collide. Each
namespace made is recorded with its owner (pid and start time) under :data:`OWNERS`, so that
:func:`remove_stale` deletes the leftovers of a run killed outright (SIGKILL), and only those:
a namespace it has no record of, or whose owner still runs (a pid reused counts as gone), is
never touched. ``--delay`` adds a ``netem`` delay in front of the token bucket (as its parent), on
both directions, so a round trip takes twice the delay.

:class:`ShapedNetwork` removes whatever it created when its ``with`` block ends, on success,
on error and on ``KeyboardInterrupt`` (the runner turns SIGTERM and SIGHUP into one), with those
signals deferred while it removes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from gravac.launch import free_port

__all__ = [
    "BASE_PORT",
    "MAX_SHAPED_NODES",
    "NAME_ROOT",
    "OWNERS",
    "SHAPED_SUBNET",
    "Loopback",
    "Network",
    "NetworkError",
    "ShapedNetwork",
    "list_namespaces",
    "parse_delay",
    "parse_rate",
    "prefix",
    "remove_stale",
    "shaping_unavailable",
    "signal_handlers",
]

#: every name a run creates starts with this, then the creating process's pid and a dash
NAME_ROOT = "gvc"
#: the folder of owner records: one file per namespace made, named after it, holding the
#: creating process's pid and start time (root only, as namespaces are; gone at reboot, as they)
OWNERS = Path("/run/gravac-netns")
#: the field of ``/proc/<pid>/stat`` (after the command's closing parenthesis, from 0) that
#: holds the process's start time in clock ticks since boot (proc(5): field 22 of the line)
_STARTTIME_FIELD = 19
#: Linux interface names hold at most 15 characters (IFNAMSIZ 16 with the terminating NUL)
_IFNAME_MAX = 15
#: the /24 the nodes' veth addresses are taken from: node n is ``.n+1``. It exists only
#: inside the run's own namespaces, so it cannot clash with the host's networks.
SHAPED_SUBNET = "10.213.0"
_PREFIX_LENGTH = 24
#: nodes the /24 has addresses for (``.1`` to ``.254``; ``.255`` is its broadcast address)
MAX_SHAPED_NODES = 254
#: where a namespace's interface counts the bytes it sent (``ip netns exec`` mounts the
#: namespace's own ``/sys``)
_TX_BYTES = "/sys/class/net/{dev}/statistics/tx_bytes"
#: the rendezvous port inside the namespaces (free: the namespaces are new); job i uses
#: ``BASE_PORT + i`` so a socket of the previous job in TIME_WAIT never blocks the next
BASE_PORT = 29500
#: loopback: the only interface the workers listen on without namespaces
LOOPBACK_HOST = "127.0.0.1"
LOOPBACK_IFNAME = "lo"

#: ``tc`` rate units (``bit`` units in bits/s; ``bps`` units are bytes/s, as in ``tc``)
_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$", re.IGNORECASE)
#: ``--delay`` units, in seconds
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_DELAY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
#: the slowest rate accepted: below it one 1500-byte packet takes over 1 ms and the gloo
#: collectives of a step take minutes
MIN_RATE_BITS = 10**6
#: the token bucket holds this much traffic at the set rate (1 Gbit/s: 125 KB) ...
_BURST_SECONDS = 1e-3
#: ... and at least one 64 KiB GSO segment, the largest packet a veth passes to ``tc``, so a
#: packet never exceeds the bucket
_MIN_BURST_BYTES = 64 * 1024
#: longest a packet may wait in the token bucket's queue before it is dropped: deep enough
#: that a TCP window in flight on a shaped 1 Gbit/s link is queued rather than dropped
_TBF_LATENCY = "50ms"
#: seconds an ``ip`` or ``tc`` command may take
_COMMAND_TIMEOUT = 30.0
#: signals deferred while namespaces are removed, so a second Ctrl-C cannot leave some behind
_DEFERRED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class NetworkError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message names it and what it printed."""


def parse_rate(text: str) -> int:
    """A ``tc`` rate such as ``1gbit``, ``100mbit`` or ``125mbps`` (bytes/s) in bits/s.

    Raises:
        ValueError: not a rate, or slower than :data:`MIN_RATE_BITS`; the message names
            ``--bandwidth``.
    """
    match = _RATE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS:
        raise ValueError(
            "--bandwidth must be a rate such as 1gbit, 100mbit or 500kbit (units "
            f"{', '.join(_RATE_UNITS)}; bps units are bytes/s, as in tc), got {text!r}"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[unit])
    if bits < MIN_RATE_BITS:
        raise ValueError(f"--bandwidth must be at least 1mbit, got {text!r}")
    return bits


def parse_delay(text: str) -> float:
    """A one-way delay such as ``1ms``, ``500us`` or ``0.01s``, in seconds.

    Raises:
        ValueError: not a delay; the message names ``--delay``.
    """
    match = _DELAY_RE.match(text)
    if not match:
        raise ValueError(f"--delay must be a duration such as 1ms, 500us or 0.01s, got {text!r}")
    return float(match.group(1)) * _DELAY_UNITS[match.group(2).lower()]


def prefix(pid: int | None = None) -> str:
    """The prefix of every namespace the run of process ``pid`` (default: this one) creates."""
    return f"{NAME_ROOT}{os.getpid() if pid is None else pid}-"


def shaping_unavailable() -> str | None:
    """Why shaped links cannot be made here, or ``None`` when they can (root, ``ip``, ``tc``)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (package iproute2)"
    return None


def _run(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"`{' '.join(argv)}` failed: {exc}") from None
    if out.returncode != 0:
        raise NetworkError(
            f"`{' '.join(argv)}` failed with status {out.returncode}: {out.stderr.strip()}"
        )
    return out.stdout


def list_namespaces(name_prefix: str = NAME_ROOT) -> list[str]:
    """The network namespaces whose names start with ``name_prefix``."""
    lines = _run(["ip", "netns", "list"]).splitlines()
    names = [line.split()[0] for line in lines if line.strip()]
    return [n for n in names if n.startswith(name_prefix)]


def _owner(pid: int) -> str | None:
    """``"<pid> <start time>"`` of a running process (``None``: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{pid} {fields[_STARTTIME_FIELD]}"


def _record(name: str) -> None:
    """Record this process as the owner of namespace ``name``."""
    OWNERS.mkdir(mode=0o700, parents=True, exist_ok=True)
    (OWNERS / name).write_text(f"{_owner(os.getpid())}\n")


def _forget(name: str) -> None:
    (OWNERS / name).unlink(missing_ok=True)


def remove_stale() -> list[str]:
    """Delete the namespaces recorded under :data:`OWNERS` whose owner is gone (a run killed
    with SIGKILL), and their records; returns their names. Nothing else is touched."""
    if not OWNERS.is_dir():
        return []
    existing = set(list_namespaces())
    stale = []
    for record in sorted(OWNERS.iterdir()):
        owner = record.read_text().strip()
        pid = owner.split()[0] if owner else ""
        if pid.isdigit() and _owner(int(pid)) == owner:
            continue  # its run is still going
        if record.name in existing:
            _run(["ip", "netns", "delete", record.name])
            stale.append(record.name)
        record.unlink()
    return stale


@contextlib.contextmanager
def signal_handlers(
    signals: Sequence[signal.Signals], handler: Callable[[int, object], None]
) -> Iterator[None]:
    """Run the block with ``handler`` for ``signals``, the previous handlers restored after.

    Only the main thread can set handlers: elsewhere the block runs with the handlers as
    they are.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Defer SIGINT, SIGTERM and SIGHUP to the end of the block, then deliver the first.

    Python handlers, not a signal mask: a mask set here would hold back signals from this
    thread only, and the kernel hands a process signal to any thread that does not mask it.
    """
    caught: list[int] = []

    def record(signum: int, frame: object) -> None:
        caught.append(signum)

    try:
        with signal_handlers(_DEFERRED, record):
            yield
    finally:
        if caught:
            signal.raise_signal(caught[0])


class Network(ABC):
    """How the workers of a run reach each other: addresses, interfaces, how to start them."""

    #: whether the links are rate-limited
    shaped: bool
    #: one line for the report
    description: str

    @abstractmethod
    def address(self, rank: int) -> str:
        """The address worker ``rank`` listens on (rank 0's is the rendezvous)."""

    @abstractmethod
    def ifname(self, rank: int) -> str:
        """The interface worker ``rank`` communicates through (``GLOO_SOCKET_IFNAME``)."""

    @abstractmethod
    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` as worker ``rank``."""

    @abstractmethod
    def port(self, job: int) -> int:
        """The rendezvous port of the run's ``job``-th job."""

    @abstractmethod
    def tx_bytes(self) -> int | None:
        """Bytes the links between nodes have sent so far, headers included (a counter: the
        difference of two reads is what was sent between them); ``None`` where they are not
        measured."""


class Loopback(Network):
    """Every worker on this machine's loopback interface, unshaped."""

    shaped = False
    description = "loopback (not shaped)"

    def address(self, rank: int) -> str:
        return LOOPBACK_HOST

    def ifname(self, rank: int) -> str:
        return LOOPBACK_IFNAME

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        return argv

    def port(self, job: int) -> int:
        return free_port()

    def tx_bytes(self) -> None:
        return None  # every worker on one interface: nothing crosses between nodes


@dataclass
class ShapedNetwork(Network):
    """Node namespaces joined by ``tc``-shaped veth links; a context manager.

    Entering creates the namespaces, links and shaping; leaving deletes every namespace it
    created (the links go with them), whatever happened in between.

    Args:
        world_size: number of workers.
        rate_bits: link rate in bits/s, each direction.
        delay: one-way delay in seconds added with ``netem`` (0: none).
        name_prefix: prefix of every name (default :func:`prefix`).
        ranks_per_node: consecutive ranks that share a node's namespace, link and address
            (default 1: a namespace per worker); it divides ``world_size`` into 2 to
            :data:`MAX_SHAPED_NODES` nodes.
    """

    world_size: int
    rate_bits: int
    delay: float = 0.0
    name_prefix: str = field(default_factory=prefix)
    ranks_per_node: int = 1
    #: namespaces created and not yet deleted
    created: list[str] = field(default_factory=list, init=False, repr=False)
    shaped = True

    def __post_init__(self) -> None:
        if (
            not isinstance(self.ranks_per_node, int)
            or self.ranks_per_node < 1
            or self.world_size % self.ranks_per_node
        ):
            raise ValueError(
                f"ranks_per_node must be an integer >= 1 dividing the {self.world_size} workers, "
                f"got {self.ranks_per_node!r}"
            )
        if not 2 <= self.nodes <= MAX_SHAPED_NODES:
            raise ValueError(
                f"a shaped network needs 2 to {MAX_SHAPED_NODES} nodes (namespaces), got "
                f"{self.nodes} ({self.world_size} workers, {self.ranks_per_node} per node)"
            )
        longest = self.link(self.nodes - 1)
        if len(longest) > _IFNAME_MAX:
            raise ValueError(
                f"interface name {longest!r} exceeds {_IFNAME_MAX} characters; use fewer nodes"
            )
        topology = "a veth pair" if self.nodes == 2 else "veth links to a bridge"
        delay = f", netem delay {self.delay * 1e3:g} ms each way" if self.delay else ""
        hosts = "network namespaces"
        if self.ranks_per_node > 1:
            hosts = (
                f"{self.nodes} node namespaces of {self.ranks_per_node} workers (a node's "
                "workers talk over its own address, unshaped)"
            )
        self.description = (
            f"{hosts} joined by {topology}, tc tbf {self.rate_bits / 1e9:g} Gbit/s each way{delay}"
        )

    # ----------------------------------------------------------------- names
    @property
    def nodes(self) -> int:
        """Node namespaces, each with its link."""
        return self.world_size // self.ranks_per_node

    def node(self, rank: int) -> int:
        """The node of worker ``rank``."""
        return rank // self.ranks_per_node

    def _ifname(self, suffix: str) -> str:
        return f"{self.name_prefix.rstrip('-')}{suffix}"

    def namespace(self, node: int) -> str:
        """The namespace of ``node``."""
        return f"{self.name_prefix}n{node}"

    def link(self, node: int) -> str:
        """``node``'s end of its veth link, in its namespace."""
        return self._ifname(f"n{node}")

    def node_address(self, node: int) -> str:
        """``node``'s address on its link."""
        return f"{SHAPED_SUBNET}.{node + 1}"

    @property
    def bridge_namespace(self) -> str:
        """The namespace holding the bridge (more than 2 nodes)."""
        return f"{self.name_prefix}br"

    def address(self, rank: int) -> str:
        return self.node_address(self.node(rank))

    def ifname(self, rank: int) -> str:
        return self.link(self.node(rank))

    def wrap(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(self.node(rank)), *argv]

    def port(self, job: int) -> int:
        return BASE_PORT + job

    def tx_bytes(self) -> int:
        """What every node's link has sent, read from its counter in the node's namespace."""
        total = 0
        for node in range(self.nodes):
            path = _TX_BYTES.format(dev=self.link(node))
            text = _run(["ip", "netns", "exec", self.namespace(node), "cat", path])
            try:
                total += int(text)
            except ValueError:
                raise NetworkError(f"{path} in {self.namespace(node)} read {text!r}") from None
        return total

    # ----------------------------------------------------------------- set up
    def __enter__(self) -> ShapedNetwork:
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def _add_namespace(self, name: str) -> None:
        _record(name)  # first: a kill between the two leaves a record, never a namespace alone
        try:
            _run(["ip", "netns", "add", name])
        except NetworkError:
            _forget(name)
            raise
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _create(self) -> None:
        for node in range(self.nodes):
            self._add_namespace(self.namespace(node))
        if self.nodes == 2:
            a, b = self.namespace(0), self.namespace(1)
            _run(["ip", "link", "add", self.link(0), "netns", a, "type", "veth", "peer",
                  "name", self.link(1), "netns", b])  # fmt: skip
        else:
            br = self.bridge_namespace
            bridge = self._ifname("br")
            self._add_namespace(br)
            _run(["ip", "-n", br, "link", "add", bridge, "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", bridge, "up"])
            for node in range(self.nodes):
                port = self._ifname(f"b{node}")
                _run(["ip", "link", "add", self.link(node), "netns", self.namespace(node),
                      "type", "veth", "peer", "name", port, "netns", br])  # fmt: skip
                _run(["ip", "-n", br, "link", "set", port, "master", bridge])
                _run(["ip", "-n", br, "link", "set", port, "up"])
                self._shape(br, port)
        for node in range(self.nodes):
            ns, dev = self.namespace(node), self.link(node)
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_address(node)}/{_PREFIX_LENGTH}",
                  "dev", dev])  # fmt: skip
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        """Limit ``dev``'s egress in ``ns`` to the rate, behind a netem delay if any."""
        burst = max(_MIN_BURST_BYTES, math.ceil(self.rate_bits / 8 * _BURST_SECONDS))
        tbf = ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst),
               "latency", _TBF_LATENCY]  # fmt: skip
        if not self.delay:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
            return
        try:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", f"{self.delay * 1e6:.0f}us"])  # fmt: skip
        except NetworkError as exc:
            raise NetworkError(
                f"--delay needs the kernel's netem queueing discipline (module sch_netem), "
                f"which tc could not use here; run without --delay. ({exc})"
            ) from None
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
              *tbf])  # fmt: skip

    # ----------------------------------------------------------------- tear down
    def remove(self) -> None:
        """Delete every namespace this network created (idempotent), signals deferred."""
        with _signals_deferred():
            errors = []
            for name in reversed(self.created):
                try:
                    _run(["ip", "netns", "delete", name])
                except NetworkError as exc:
                    errors.append(str(exc))
                else:
                    _forget(name)
            self.created.clear()
        if errors:
            raise NetworkError("could not remove every namespace: " + "; ".join(errors))
