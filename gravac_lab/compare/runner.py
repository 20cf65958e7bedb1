"""Run a ``gravac compare`` measurement: the network, then every job's workers, then a summary.

:func:`run_compare` sets up the network (:mod:`gravac_lab.compare.netns`: shaped links between
namespaces, or loopback), measures a shaped link's throughput, then runs the study's jobs
(:meth:`gravac_lab.compare.study.Study.jobs`: every mode, gravac variant and seed) one after
another, each as fresh worker processes (:mod:`gravac_lab.compare.worker`) on its own
configuration, and returns the summary: every run's (:class:`gravac_lab.compare.report.ModeSummary`)
and every mode and variant's over the seeds (:mod:`gravac_lab.compare.aggregate`), which
:func:`gravac_lab.compare.report.format_table` lays out. Every rank records the CF it sent each
step; a run where a rank's differ from rank 0's is logged and marked (``ranks_agree``).

Each rank has one fork server for the run (:mod:`gravac_lab.compare.forkserver`, through its
:class:`~gravac_lab.compare.host.Host`), started as a subprocess (inside ``ip netns exec`` of its
node's namespace when links are shaped) with ``GLOO_SOCKET_IFNAME`` naming the rank's interface
(its node's link, or loopback) and torchrun's variables for its node where there are several
(:meth:`gravac_lab.compare.layout.NodeLayout.torchrun_env`). It imports the training code once
and forks the rank's worker of each job from there, its stdout sent to stderr, so that stdout
carries only the result. On shaped links the bytes the links between nodes sent
during each training job (:meth:`gravac_lab.compare.netns.Network.tx_bytes`, read before and
after it) go into its summary.

A job fails as soon as one worker fails (the others are killed: they would wait for it forever)
or when it outlives ``--timeout``; the error carries the failed worker's traceback. Whatever
happens, workers and fork servers are ended and namespaces deleted before :func:`run_compare`
returns or raises; SIGTERM and SIGHUP are turned into ``KeyboardInterrupt`` for the duration,
as Ctrl-C is, so that they clean up too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gravac_lab.compare import modes, netns, workloads
from gravac_lab.compare.aggregate import aggregate
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.host import Host, HostError, server_argv
from gravac_lab.compare.report import decisions_agree, summarise
from gravac_lab.compare.study import Study
from gravac_lab.compare.train import LINK_TEST_JOB

__all__ = ["CompareError", "cpu_name", "run_compare"]

#: seconds between checks on the workers of a job
_POLL_SECONDS = 0.1
#: in a run's working directory: the workload's data, loaded once here and the same for every
#: rank and job (each worker saves scikit-learn's import); each job's configuration is
#: ``job<index>.json`` beside it
_DATA_FILE = "data.pt"
#: where Linux names the processor (:func:`cpu_name`)
_CPUINFO = "/proc/cpuinfo"
#: signals that end a run as Ctrl-C does (cleaning up)
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def cpu_name() -> str | None:
    """The processor's model name as Linux reports it (``/proc/cpuinfo``); ``None`` elsewhere.
    With torch's CPU kernel level beside it in a study's ``host``, it tells whether two studies
    ran on the same kind of machine: their float results may differ where they did not."""
    try:
        with open(_CPUINFO) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        return None
    return None


class CompareError(RuntimeError):
    """A job failed: a worker raised or exited, or the job outlived ``--timeout``."""


def _log(message: str) -> None:
    print(f"gravac compare: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``KeyboardInterrupt`` within the block (main thread)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    with netns.signal_handlers(_TERMINATING, interrupt):
        yield


@contextlib.contextmanager
def _network(cfg: CompareConfig, unavailable: str | None) -> Iterator[netns.Network]:
    rate = cfg.rate_bits
    if rate is None or unavailable is not None:
        yield netns.Loopback()
        return
    netns.remove_stale()
    with netns.ShapedNetwork(
        cfg.workers, rate, cfg.delay_seconds, ranks_per_node=cfg.layout.ranks_per_host
    ) as network:
        yield network


def _failure(job: str, rank: int, status: int, result: Path) -> str:
    try:
        error = json.loads(result.read_text()).get("error")
    except (OSError, ValueError):
        error = None
    if error:
        return f"{job}: worker {rank} failed:\n{error}"
    return f"{job}: worker {rank} exited with status {status} without a result"


@contextlib.contextmanager
def _hosts(cfg: CompareConfig, network: netns.Network) -> Iterator[list[Host]]:
    """One :class:`~gravac_lab.compare.host.Host` a rank for the whole run, in the rank's
    namespace, with its environment; on leaving, every worker still running (a job that failed
    or was interrupted) is killed, then each server ended."""
    hosts: list[Host] = []
    try:
        for rank in range(cfg.workers):
            env = {
                **os.environ,
                **cfg.layout.torchrun_env(rank),
                "GLOO_SOCKET_IFNAME": network.ifname(rank),
                "OMP_NUM_THREADS": str(cfg.threads),
            }
            argv = network.wrap(rank, server_argv(sys.executable))
            hosts.append(Host(rank, argv, env))
        yield hosts
    finally:
        for host in hosts:
            host.close()


def _run_job(
    job: str,
    index: int,
    cfg: CompareConfig,
    network: netns.Network,
    workdir: Path,
    hosts: list[Host],
    *,
    name: str | None = None,
) -> list[Any]:
    """Run ``job`` (a mode, or the link test) with ``cfg`` on every rank, a worker forked by
    each rank's fork server (``hosts``); each rank's result, in rank order. Errors name the job
    ``name`` (default: ``job``)."""
    name = job if name is None else name
    master = f"{network.address(0)}:{network.port(index)}"
    config, data = workdir / f"job{index}.json", workdir / _DATA_FILE
    config.write_text(cfg.to_json())
    results = [workdir / f"job{index}-rank{rank}.json" for rank in range(cfg.workers)]
    deadline = time.monotonic() + cfg.timeout
    try:
        for rank, host in enumerate(hosts):
            argv = [
                "--config", str(config), "--data", str(data), "--job", job,
                "--rank", str(rank), "--world-size", str(cfg.workers), "--master", master,
                "--result", str(results[rank]),
            ]  # fmt: skip
            if not host.start(argv, deadline):
                raise CompareError(
                    f"{name}: workers did not start within --timeout {cfg.timeout:g} s"
                )
        running = set(range(cfg.workers))
        while running:
            for rank in sorted(running):
                status = hosts[rank].poll()
                if status is None:
                    continue
                running.discard(rank)
                if status != 0:
                    raise CompareError(_failure(name, rank, status, results[rank]))
            if running and time.monotonic() > deadline:
                raise CompareError(
                    f"{name}: workers did not finish within --timeout {cfg.timeout:g} s"
                )
            time.sleep(_POLL_SECONDS)
    except HostError as e:
        raise CompareError(f"{name}: {e}") from e
    return [json.loads(path.read_text())["result"] for path in results]


def run_compare(study: Study | CompareConfig) -> dict[str, Any]:
    """Run every job of ``study`` (a configuration alone: its modes, its compression options
    and its seed); the summary of the run (JSON-serialisable): ``config`` (shared by every
    job; a job's variant and seed replace its compression options and seed), ``study`` (the
    variants and seeds), ``workload``, ``layout`` (the nodes,
    :meth:`~gravac_lab.compare.layout.NodeLayout.to_dict`), ``network``, ``runs`` (every job's
    :class:`~gravac_lab.compare.report.ModeSummary`), ``aggregates`` (every mode and variant's
    :class:`~gravac_lab.compare.aggregate.Aggregate`), ``host`` and ``seconds``.

    Raises:
        CompareError: a job failed.
        gravac_lab.compare.netns.NetworkError: the shaped links could not be made or removed.
    """
    if isinstance(study, CompareConfig):
        study = Study(study)
    cfg = study.config
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    workload = workloads.get(cfg.workload)
    unavailable = netns.shaping_unavailable() if cfg.bandwidth is not None else None
    if unavailable is not None:
        _log(f"--bandwidth {cfg.bandwidth} needs shaped links: {unavailable}; using loopback")
    with (
        _terminate_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="gravac-compare-") as tmp,
        _network(cfg, unavailable) as network,
        _hosts(cfg, network) as hosts,
    ):
        workdir = Path(tmp)
        torch.save(workload.data(), workdir / _DATA_FILE)
        _log(f"network: {network.description}")
        jobs = 0
        link = None
        if network.shaped and cfg.link_test_mb:
            _log(f"measuring the link: gloo all_reduce of {cfg.link_test_mb} MiB")
            link = _run_job(LINK_TEST_JOB, jobs, cfg, network, workdir, hosts)[0]
            jobs += 1
            _log(f"link: {link['gbit_per_s']:.3f} Gbit/s")
        summaries = []
        for job in study.jobs():
            _log(f"{job.name}: {cfg.layout.describe()}, {cfg.steps} steps")
            job_started = time.perf_counter()
            before = network.tx_bytes()
            raws = _run_job(job.mode, jobs, job.config, network, workdir, hosts, name=job.name)
            after = network.tx_bytes()
            internode = None if before is None or after is None else after - before
            jobs += 1
            agree = decisions_agree(raws)
            if agree is False:
                _log(f"{job.name}: the ranks sent at different CFs (gravac's decisions disagree)")
            variant = None if job.variant is None else job.variant.label
            summaries.append(
                summarise(
                    modes.get(job.mode),
                    job.config,
                    raws[0],
                    variant=variant,
                    ranks_agree=agree,
                    internode_bytes=internode,
                )
            )
            _log(f"{job.name}: done in {time.perf_counter() - job_started:.1f} s")
    return {
        "config": cfg.resolved(),
        "study": study.to_dict(),
        "workload": {
            "name": workload.name,
            "summary": workload.summary,
            "parameters": summaries[0].parameters,
            "metric": workload.metric_name,
            "target": cfg.target_value,
        },
        "layout": cfg.layout.to_dict(),
        "network": {
            "shaped": network.shaped,
            "description": network.description,
            "bandwidth": cfg.bandwidth if network.shaped else None,
            "delay": cfg.delay if network.shaped else None,
            "measured_gbit_per_s": None if link is None else link["gbit_per_s"],
            "link_test": link,
            "note": None if unavailable is None else f"not shaped: {unavailable}",
        },
        "runs": [asdict(s) for s in summaries],
        "aggregates": [asdict(a) for a in aggregate(summaries)],
        "host": {
            "cpus": os.cpu_count(),
            "cpu": cpu_name(),
            "torch_cpu": torch.backends.cpu.get_cpu_capability(),
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
        },
        "seconds": time.perf_counter() - started,
    }
