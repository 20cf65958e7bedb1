"""From the workers' raw measurements to a mode's summary, and the summary as a markdown table.

:func:`summarise` reduces rank 0's raw record of a mode (:func:`gravac.compare.train.train_mode`)
to a :class:`ModeSummary`: medians over the timed steps, bytes sent, the metric and the time to
reach its target. :func:`format_table` lays out a whole run.

Communication time is reported as measured where it can be, and derived where it cannot:

* gravac modes (``comm_source == "record"``): ``StepRecord.comm_seconds``, the communication
  not hidden behind backward, and ``compress_seconds``, as gravac measures them;
* DDP modes (``"exposed"``): DDP all-reduces during backward and exposes no timer, so the
  communication is the forward and backward time beyond the bare model's (``compute``): what
  backward waited for the all-reduce, including the hook's own work (fp16 casts, PowerSGD's
  matrix products). Communication hidden behind backward does not show, as it costs nothing.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gravac.compare import workloads
from gravac.compare.config import CompareConfig
from gravac.compare.modes import FLOAT32_BYTES, Mode

__all__ = ["ModeSummary", "format_table", "summarise"]

#: bytes in the table's MB
_MB = 1e6
#: milliseconds in a second
_MS = 1e3


@dataclass(frozen=True)
class ModeSummary:
    """What one mode did, from rank 0's measurements (times in seconds, medians over the timed
    steps).

    Attributes:
        mode: the mode's name.
        steps: steps trained.
        timed_from: the first step (1-based) in the medians.
        step_seconds: zero_grad, forward, backward and optimizer step.
        forward_backward_seconds: zero_grad, forward and backward (DDP's all-reduce included).
        compute_seconds: forward and backward of the bare model, timed apart.
        compress_seconds: compression, where the mode measures it.
        comm_seconds: communication not hidden behind backward (see the module docstring).
        comm_source: ``"record"`` (measured by gravac) or ``"exposed"`` (derived).
        other_seconds: the rest of the step: the optimizer update and, for gravac, what it does
            besides compressing and waiting (decompression, error feedback, bookkeeping).
        wire_bytes: bytes rank 0 put into the collectives over the run.
        wire_bytes_per_step: the same per timed step (median).
        dense_wire_bytes_per_step: what a float32 all-reduce of every parameter sends a step.
        parameters: trainable parameters of the model.
        final_metric: the metric after the last step.
        target: the metric value the time to target is measured at.
        time_to_target_seconds: training seconds (evaluation excluded) until the first
            evaluation that reaches ``target`` (at or above it, or at or below it for a metric
            where lower is better); ``None`` if none was.
        steps_to_target: the step of that evaluation.
        evaluations: ``(step, training seconds, metric)`` of every evaluation.
        options: what the mode ran with beyond the configuration.
    """

    mode: str
    steps: int
    timed_from: int
    step_seconds: float
    forward_backward_seconds: float
    compute_seconds: float
    compress_seconds: float | None
    comm_seconds: float | None
    comm_source: str
    other_seconds: float
    wire_bytes: int
    wire_bytes_per_step: float
    dense_wire_bytes_per_step: int
    parameters: int
    final_metric: float
    target: float
    time_to_target_seconds: float | None
    steps_to_target: int | None
    evaluations: list[tuple[int, float, float]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(mode: Mode, cfg: CompareConfig, raw: dict[str, Any]) -> ModeSummary:
    """Rank 0's raw measurements of ``mode`` (see :func:`gravac.compare.train.train_mode`)."""
    start = mode.timed_from(cfg)
    step = statistics.median(raw["step_seconds"][start:])
    forward_backward = statistics.median(raw["forward_backward_seconds"][start:])
    compute = statistics.median(raw["compute_seconds"])
    if mode.comm_source == "record":
        compress = _median(raw["compress_seconds"][start:])
        comm = _median(raw["comm_seconds"][start:])
    else:
        compress, comm = None, max(0.0, forward_backward - compute)
    evaluations = [(int(s), float(t), float(v)) for s, t, v in raw["evaluations"]]
    target = cfg.target_value
    workload = workloads.get(cfg.workload)
    reached = next(((s, t) for s, t, v in evaluations if workload.reached(v, target)), None)
    return ModeSummary(
        mode=mode.name,
        steps=len(raw["step_seconds"]),
        timed_from=start + 1,
        step_seconds=step,
        forward_backward_seconds=forward_backward,
        compute_seconds=compute,
        compress_seconds=compress,
        comm_seconds=comm,
        comm_source=mode.comm_source,
        other_seconds=max(0.0, step - compute - (compress or 0.0) - (comm or 0.0)),
        wire_bytes=sum(raw["wire_bytes"]),
        wire_bytes_per_step=statistics.median(raw["wire_bytes"][start:]),
        dense_wire_bytes_per_step=raw["parameters"] * FLOAT32_BYTES,
        parameters=raw["parameters"],
        final_metric=evaluations[-1][2],
        target=target,
        time_to_target_seconds=None if reached is None else reached[1],
        steps_to_target=None if reached is None else reached[0],
        evaluations=evaluations,
        options=raw["options"],
    )


def _ms(seconds: float | None, mark: str = "") -> str:
    return "–" if seconds is None else f"{seconds * _MS:.1f}{mark}"


def _options(options: dict[str, Any]) -> str:
    return f" {json.dumps(options)}" if options else ""


def _mode_lines(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Header lines with the options of the modes run that have any."""
    names = {r["mode"] for r in rows}
    lines = []
    if names & {"gravac", "gravac-ddp"}:
        overlap = next((r["options"].get("overlap") for r in rows if r["mode"] == "gravac"), None)
        lines.append(
            f"- gravac: compressor {cfg['compressor']}{_options(cfg['compressor_options'])}, "
            f"policy {cfg['policy']}{_options(cfg['policy_options'])}, CF range "
            f"{cfg['theta_min']:g}-{cfg['theta_max']:g}"
            + ("" if overlap is None else f", overlap {overlap}")
        )
    if "ddp-powersgd" in names:
        lines.append(
            f"- ddp-powersgd: rank {cfg['powersgd_rank']}, float32 all-reduce before step "
            f"{cfg['powersgd_start'] + 1}, one DDP bucket (torch's hook mis-orders gloo "
            "collectives across buckets)"
        )
    return lines


def format_table(summary: dict[str, Any]) -> str:
    """A run's summary (:func:`gravac.compare.runner.run_compare`) as markdown: a header, the
    table of modes, and what each column measures."""
    cfg, workload, network = summary["config"], summary["workload"], summary["network"]
    host = summary["host"]
    link = network["description"]
    if network.get("measured_gbit_per_s") is not None:
        link += (
            f"; measured {network['measured_gbit_per_s']:.3f} Gbit/s "
            f"(gloo all_reduce of {cfg['link_test_mb']} MiB)"
        )
    if network.get("note"):
        link += f"; {network['note']}"
    rows = summary["modes"]
    timed = ", ".join(f"{r['mode']} from step {r['timed_from']}" for r in rows)
    target = f"{workload['target']:g}"
    lines = [
        f"- workload: {workload['name']} ({workload['summary']}, {workload['parameters']:,} "
        f"parameters); {cfg['workers']} workers x batch {cfg['batch_size']}, {cfg['steps']} "
        f"steps, SGD lr {cfg['lr']:g} momentum {cfg['momentum']:g}, {cfg['threads']} torch "
        "thread(s) per worker",
        f"- network: {link}",
        f"- host: {host['cpus']} CPUs, 1-minute load average {host['load_before']:.2f} before "
        f"the run and {host['load_after']:.2f} after it (its own workers included): other "
        "load skews the times",
        *_mode_lines(cfg, rows),
        f"- medians over the timed steps ({timed})",
        "",
        f"| mode | step ms | compute ms | compress ms | comm ms | other ms | MB sent/step "
        f"| reduction | time to {target} (s) | final {workload['metric']} |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        mark = "*" if r["comm_source"] == "exposed" else ""
        per_step = r["wire_bytes_per_step"]
        ratio = r["dense_wire_bytes_per_step"] / per_step if per_step else float("inf")
        reached = r["time_to_target_seconds"]
        lines.append(
            f"| {r['mode']} | {_ms(r['step_seconds'])} | {_ms(r['compute_seconds'])} "
            f"| {_ms(r['compress_seconds'])} | {_ms(r['comm_seconds'], mark)} "
            f"| {_ms(r['other_seconds'])} | {per_step / _MB:.3f} | {ratio:.1f}x "
            f"| {'not reached' if reached is None else f'{reached:.1f}'} "
            f"| {r['final_metric']:.4f} |"
        )
    lines += [
        "",
        "step: zero_grad, forward, backward and optimizer step. compute: forward and backward "
        "of the bare model (no DDP, no hooks), timed apart after training. comm: gravac modes "
        "measure the communication not hidden behind backward (StepRecord.comm_seconds); "
        "\\* DDP modes expose no timer, so it is the forward and backward time beyond compute: "
        "what backward waited for the all-reduce, the hook's own work included. other: the rest "
        "of the step (optimizer update; gravac's decompression and bookkeeping). MB sent/step: "
        "what one worker puts into the collectives (median); reduction: a float32 all-reduce "
        "of every parameter over that. Time to target: training seconds, evaluation "
        "excluded.",
    ]
    return "\n".join(lines)
