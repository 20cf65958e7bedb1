"""One rank's work in a ``gravac compare`` job: :func:`main`, in a process of its own.

The rank's fork server (:mod:`gravac_lab.compare.forkserver`) forks one per job, inside the
network namespace of the rank's node when links are shaped; ``python -m
gravac_lab.compare.worker`` runs one alone. A worker joins the gloo group at ``--master`` (with
``GLOO_SOCKET_IFNAME`` naming its interface, and torchrun's variables for its node where there
are several, set by the runner), runs ``--job`` (a mode's name,
or :data:`gravac_lab.compare.train.LINK_TEST_JOB`) on the workload's data that the runner saved
once at ``--data``, and writes ``{"ok": true, "result": ...}`` to ``--result``, or
``{"ok": false, "error": traceback}`` when it fails (then exits with status 1)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gravac.launch import release_group
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.train import LINK_TEST_JOB, link_throughput, train_mode

__all__ = ["main"]


def _write(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON at ``path`` atomically: the runner never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _run(job: str, cfg: CompareConfig, rank: int, world_size: int, master: str, data: Path) -> Any:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout),
    )
    try:
        if job == LINK_TEST_JOB:
            out: Any = link_throughput(cfg, world_size)
        else:
            out = train_mode(job, cfg, rank, world_size, torch.load(data, weights_only=True))
        release_group()  # leave together, nothing left holding the group
    finally:
        dist.destroy_process_group()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker; the exit status (0, or 1 after writing the error)."""
    parser = argparse.ArgumentParser(prog="python -m gravac_lab.compare.worker")
    parser.add_argument("--config", type=Path, required=True, help="CompareConfig as JSON")
    parser.add_argument("--data", type=Path, required=True, help="the workload's data (torch)")
    parser.add_argument("--job", required=True, help=f"a mode name, or {LINK_TEST_JOB}")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    parser.add_argument("--result", type=Path, required=True, help="where to write the result")
    args = parser.parse_args(argv)
    try:
        cfg = CompareConfig.from_json(args.config.read_text())
        torch.set_num_threads(cfg.threads)
        out = _run(args.job, cfg, args.rank, args.world_size, args.master, args.data)
    except BaseException:
        _write(args.result, {"ok": False, "error": traceback.format_exc()})
        return 1
    _write(args.result, {"ok": True, "result": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
