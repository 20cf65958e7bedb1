"""From the workers' raw measurements to a run's summary, and a study's as a markdown table.

:func:`summarise` reduces rank 0's raw record of a run (:func:`gravac_lab.compare.train.train_mode`)
to a :class:`ModeSummary`: medians over the timed steps, bytes sent, the metric and the time to
reach its target, and the per-step series (bytes, CF sent) the plots draw;
:func:`decisions_agree` checks every rank's CFs against rank 0's. :func:`format_table` lays out
a whole study, one row a mode and variant over the seeds (:mod:`gravac_lab.compare.aggregate`).

Communication time is reported as measured where it can be, and derived where it cannot:

* gravac modes (``comm_source == "record"``): ``StepRecord.comm_seconds``, the communication
  not hidden behind backward, and ``compress_seconds``, as gravac measures them;
* DDP modes (``"exposed"``): DDP all-reduces during backward and exposes no timer, so the
  communication is the forward and backward time beyond the bare model's (``compute``): what
  backward waited for the all-reduce, including the hook's own work (fp16 casts, PowerSGD's
  matrix products). Communication hidden behind backward does not show, as it costs nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gravac_lab.compare import modes, workloads
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.modes import FLOAT32_BYTES, Mode

__all__ = ["ModeSummary", "decisions_agree", "format_table", "summarise"]

#: bytes in the table's MB
_MB = 1e6
#: milliseconds in a second
_MS = 1e3
#: what the inter-node column measures, for the legend under the table
_INTERNODE_LEGEND = (
    " inter-node MB/step: what the links between the nodes' namespaces sent during the job "
    "(the tx counters of every node's link, Ethernet, IP and TCP headers, the group's setup "
    "and the last barrier included), over the steps trained."
)


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
        variant: the label of the gravac variant run (:mod:`gravac_lab.compare.study`); ``None``
            for a mode without variants.
        seed: the run's ``CompareConfig.seed``.
        ranks_agree: whether every rank sent at the same CF at every step
            (:func:`decisions_agree`); ``None`` for a mode that decides no CF.
        internode_bytes: bytes the shaped links between nodes carried during the run's job
            (every node's link, headers, the group's setup and the last barrier included; with
            one node every worker is a node of its own); ``None`` on loopback.
        internode_bytes_per_step: the same over the steps trained.
        wire_bytes_by_step: bytes rank 0 put into the collectives, per step.
        cf_sent_by_step, cf_achieved_by_step: the CF each step sent at and the CF its
            compressor delivered, per step (``None`` where the mode decides none, or for a step
            gravac skipped).
        gain_step_by_step, gain_window_by_step: gravac's per-step gain of what was sent and
            the window gains (``gravac.control.window``), per step (``None`` where not measured).
        gain_shadow_by_step: the shadow window gains by CF (``gravac.control.replay``), per step
            (``None`` where not measured).
        signal_by_step: the signal share of the window's gradient (``gravac.control.noise``), per
            step (``None`` where not measured).
        judged_by_step: by CF, the judged gain and the estimated samples/s that the search by
            shadow chose the next window's CF by (``gravac.control.searches.shadow``), per step
            (``None`` where it chose none; within, ``None`` for a value it did not know).
        lr_by_step: the learning rate each step trained at (``--lr-milestones`` decay it).
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
    variant: str | None = None
    seed: int = 0
    ranks_agree: bool | None = None
    internode_bytes: int | None = None
    internode_bytes_per_step: float | None = None
    wire_bytes_by_step: list[int] = field(default_factory=list)
    cf_sent_by_step: list[float | None] = field(default_factory=list)
    cf_achieved_by_step: list[float | None] = field(default_factory=list)
    gain_step_by_step: list[float | None] = field(default_factory=list)
    gain_window_by_step: list[float | None] = field(default_factory=list)
    gain_shadow_by_step: list[dict[str, float] | None] = field(default_factory=list)
    signal_by_step: list[float | None] = field(default_factory=list)
    judged_by_step: list[dict[str, list[float | None]] | None] = field(default_factory=list)
    lr_by_step: list[float] = field(default_factory=list)


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def decisions_agree(raws: Sequence[dict[str, Any]]) -> bool | None:
    """Whether every rank's raw record (:func:`gravac_lab.compare.train.train_mode`) sent at the
    same CF at every step as rank 0's (the first); ``None`` when rank 0 recorded no CF (a DDP
    mode). gravac's ranks agree on what to send each step, so ``False`` is a bug."""
    sent = raws[0]["cf_sent"]
    if all(cf is None for cf in sent):
        return None
    return all(raw["cf_sent"] == sent for raw in raws[1:])


def summarise(
    mode: Mode,
    cfg: CompareConfig,
    raw: dict[str, Any],
    *,
    variant: str | None = None,
    ranks_agree: bool | None = None,
    internode_bytes: int | None = None,
) -> ModeSummary:
    """Rank 0's raw measurements of ``mode`` (see :func:`gravac_lab.compare.train.train_mode`),
    run with ``cfg`` (its ``seed``) and the gravac variant labelled ``variant``; ``ranks_agree``
    is :func:`decisions_agree` of every rank's; ``internode_bytes`` what the links between
    nodes carried during the job (``None``: not measured)."""
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
    steps = len(raw["step_seconds"])
    return ModeSummary(
        mode=mode.name,
        steps=steps,
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
        variant=variant,
        seed=cfg.seed,
        ranks_agree=ranks_agree,
        internode_bytes=internode_bytes,
        internode_bytes_per_step=None if internode_bytes is None else internode_bytes / steps,
        wire_bytes_by_step=[int(b) for b in raw["wire_bytes"]],
        cf_sent_by_step=list(raw["cf_sent"]),
        cf_achieved_by_step=list(raw["cf_achieved"]),
        gain_step_by_step=list(raw.get("gain_step", [])),
        gain_window_by_step=list(raw.get("gain_window", [])),
        gain_shadow_by_step=list(raw.get("gain_shadow", [])),
        signal_by_step=list(raw.get("signal", [])),
        judged_by_step=list(raw.get("judged", [])),
        lr_by_step=[float(v) for v in raw.get("lr", [])],
    )


def _number(value: float | None, scale: float, digits: int, missing: str) -> str:
    return missing if value is None else f"{value * scale:.{digits}f}"


def _cell(
    spread: dict[str, float | None],
    *,
    scale: float = 1.0,
    digits: int = 1,
    mark: str = "",
    censored: bool = False,
) -> str:
    """A figure over seeds (:class:`gravac_lab.compare.aggregate.Spread` as a dict): the median,
    and the range where the seeds differ as printed. ``censored``: ``None`` is a target not
    reached."""
    missing = "not reached" if censored else "–"
    median, low, high = (
        _number(spread[k], scale, digits, missing) for k in ("median", "min", "max")
    )
    return median + mark + ("" if low == high else f" ({low}-{high})")


def _variant_lines(summary: dict[str, Any]) -> list[str]:
    """Header lines: the gravac variants, if a mode ran them, the nodes gravac aggregated in
    (with several nodes, or two-level aggregation), PowerSGD's options, DDP's bucket views, and
    the runs whose ranks disagreed."""
    cfg, runs = summary["config"], summary["runs"]
    names = list(dict.fromkeys(r["mode"] for r in runs))
    takers = [n for n in names if modes.get(n).takes_variants]
    lines = []
    if takers:
        overlap = next((r["options"].get("overlap") for r in runs if r["mode"] == "gravac"), None)
        variants = "; ".join(
            f"{v['label']} = `{v['spec'].split('=', 1)[1]}`" for v in summary["study"]["variants"]
        )
        lines.append(
            f"- gravac variants ({', '.join(takers)}): {variants}; CF range "
            f"{cfg['theta_min']:g}-{cfg['theta_max']:g}"
            + ("" if overlap is None else f", overlap {overlap}")
        )
    aggregated = [r for r in runs if "topology" in r["options"]]
    topologies = {f"{r['mode']} {r['variant']}": r["options"]["topology"] for r in aggregated}
    grouped = summary.get("layout", {}).get("nodes", 1) > 1
    two_level = any(r["options"][modes.RANKS_PER_NODE] > 1 for r in aggregated)
    if topologies and (grouped or two_level):
        lines.append(
            "- gravac aggregated in: "
            + "; ".join(f"{run}: {topology}" for run, topology in topologies.items())
        )
    if "ddp-powersgd" in names:
        lines.append(
            f"- ddp-powersgd: rank {cfg['powersgd_rank']}, float32 all-reduce before step "
            f"{cfg['powersgd_start'] + 1}, one DDP bucket (torch's hook mis-orders gloo "
            "collectives across buckets)"
        )
    if any(modes.get(n).runs_ddp for n in names):
        # summaries written before the option ran DDP with its default, False
        lines.append(f"- DDP's gradient_as_bucket_view: {cfg.get('bucket_view', False)}")
    disagree = [
        f"{r['mode']} {r['variant']} seed {r['seed']}" for r in runs if r["ranks_agree"] is False
    ]
    if disagree:
        lines.append(f"- ! the ranks sent at different CFs in: {', '.join(disagree)}")
    return lines


def _cpu_text(host: dict[str, Any]) -> str:
    """`` (model, torch's CPU kernels: level)`` from a study's ``host``, as far as it names them
    (the JSON of older studies does not): empty where it names neither."""
    parts = [
        *([str(host["cpu"])] if host.get("cpu") else []),
        *([f"torch's CPU kernels: {host['torch_cpu']}"] if host.get("torch_cpu") else []),
    ]
    return f" ({', '.join(parts)})" if parts else ""


def _optimizer_text(cfg: dict[str, Any]) -> str:
    """What every mode trained with: ``SGD lr L momentum M`` or ``Adam lr L`` (runs stored
    before ``--optimizer`` trained with SGD)."""
    if cfg.get("optimizer", "sgd") == "adam":
        return f"Adam lr {cfg['lr']:g}"
    return f"SGD lr {cfg['lr']:g} momentum {cfg['momentum']:g}"


def _internode(summary: dict[str, Any]) -> tuple[list[str], bool]:
    """The header line of a run on several nodes (none on one), and whether the table has the
    inter-node column (several nodes, on shaped links)."""
    layout = summary.get("layout")  # absent from the JSON of runs before nodes
    if layout is None or layout["nodes"] <= 1:
        return [], False
    shaped = summary["network"]["shaped"]
    where = (
        "a node's workers share one network namespace and talk over its own address "
        "(unshaped), the links between nodes are shaped"
        if shaped
        else "all on loopback (inter-node bytes not measured)"
    )
    line = (
        f"- nodes: {layout['description']}; {where}; every worker has torchrun's LOCAL_RANK and "
        "LOCAL_WORLD_SIZE (gravac's ranks_per_node None finds the nodes from them)"
    )
    return [line], shaped


def format_table(summary: dict[str, Any]) -> str:
    """A run's summary (:func:`gravac_lab.compare.runner.run_compare`) as markdown: a header, the
    table of modes and variants over the seeds, and what each column measures."""
    cfg, workload, network = summary["config"], summary["workload"], summary["network"]
    host, seeds = summary["host"], summary["study"]["seeds"]
    link = network["description"]
    if network.get("measured_gbit_per_s") is not None:
        link += (
            f"; measured {network['measured_gbit_per_s']:.3f} Gbit/s "
            f"(gloo all_reduce of {cfg['link_test_mb']} MiB)"
        )
    if network.get("note"):
        link += f"; {network['note']}"
    rows = summary["aggregates"]
    timed_from = {r["mode"]: r["timed_from"] for r in summary["runs"]}
    timed = ", ".join(f"{mode} from step {step}" for mode, step in timed_from.items())
    target = f"{workload['target']:g}"
    stop_at = cfg.get("stop_at")  # absent from the JSON of older runs
    until = "" if stop_at is None else f" (at most: a run stops once it holds {stop_at:g})"
    node_lines, internode = _internode(summary)
    lines = [
        f"- workload: {workload['name']} ({workload['summary']}, {workload['parameters']:,} "
        f"parameters); {cfg['workers']} workers x batch {cfg['batch_size']}, {cfg['steps']} "
        f"steps{until}, {_optimizer_text(cfg)}, {cfg['threads']} torch thread(s) per worker",
        f"- network: {link}",
        *node_lines,
        f"- host: {host['cpus']} CPUs{_cpu_text(host)}, 1-minute load average "
        f"{host['load_before']:.2f} before the run and {host['load_after']:.2f} after it (its "
        "own workers included): other load skews the times",
        *_variant_lines(summary),
        f"- seeds {', '.join(map(str, seeds))}: every figure is the median over the seeds, "
        "with the lowest and highest in brackets where they differ",
        f"- medians over the timed steps ({timed})",
        "",
        f"| mode | variant | step ms | compute ms | compress ms | comm ms | other ms "
        f"| MB sent/step | reduction {'| inter-node MB/step ' if internode else ''}| MB sent "
        f"| reached {target} | steps to {target} | time to {target} (s) "
        f"| final {workload['metric']} |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if internode else ""),
    ]
    for r in rows:
        f = r["figures"]
        mark = "*" if r["comm_source"] == "exposed" else ""
        per_step = f["wire_bytes_per_step"]["median"]
        ratio = r["dense_wire_bytes_per_step"] / per_step if per_step else float("inf")
        lines.append(
            f"| {r['mode']} | {r['variant'] or '–'} | {_cell(f['step_seconds'], scale=_MS)} "
            f"| {_cell(f['compute_seconds'], scale=_MS)} "
            f"| {_cell(f['compress_seconds'], scale=_MS)} "
            f"| {_cell(f['comm_seconds'], scale=_MS, mark=mark)} "
            f"| {_cell(f['other_seconds'], scale=_MS)} | {per_step / _MB:.3f} | {ratio:.1f}x "
            + (f"| {_internode_cell(f)} " if internode else "")
            + f"| {_cell(f['wire_bytes'], scale=1 / _MB)} | {r['reached']}/{len(r['seeds'])} "
            f"| {_cell(f['steps_to_target'], digits=0, censored=True)} "
            f"| {_cell(f['time_to_target_seconds'], censored=True)} "
            f"| {_cell(f['final_metric'], digits=4)} |"
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
        "of every parameter over that; MB sent: over the whole run. reached: seeds that reached "
        "the target. Steps and time to target: the first evaluation at the target; time in "
        "training seconds, evaluation excluded." + (_INTERNODE_LEGEND if internode else ""),
    ]
    return "\n".join(lines)


def _internode_cell(figures: dict[str, Any]) -> str:
    """The inter-node MB a step over seeds (a summary of runs before nodes has none)."""
    spread = figures.get("internode_bytes_per_step")
    return "–" if spread is None else _cell(spread, scale=1 / _MB, digits=3)
