"""One configuration for both front ends, validated once, and the engine built from it.

:class:`GravacConfig` holds the compression, search and engine options that
:class:`gravac.GravacOptimizer`, :class:`gravac.ddp.GravacHookState` and ``gravac compare``
share; each takes a ``config`` and accepts the same fields as keyword arguments, as sugar.
:func:`build_engine` builds the :class:`gravac.engine.Engine` from one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gravac import compressors
from gravac.checks import is_integer
from gravac.comm import Communicator
from gravac.compressors.base import Compressor
from gravac.control import policies
from gravac.control.options import ControllerConfig
from gravac.control.policies.base import ScalingPolicy
from gravac.engine import Engine
from gravac.hierarchy import NODE_PRECISIONS, NODE_STAGES
from gravac.memory import NoMemory

__all__ = [
    "LOCAL_FIELDS",
    "MIN_STEP_TIMEOUT",
    "NONFINITE_CHOICES",
    "SEARCH_OPTIONS",
    "GravacConfig",
    "build_engine",
    "learning_rate",
    "make_config",
]

#: what a non-finite gradient or aggregate does: skip the step on every rank, or raise
NONFINITE_CHOICES = ("skip", "raise")
#: the shortest step timeout, seconds: collectives' timeouts count whole milliseconds, and a
#: zero one means none
MIN_STEP_TIMEOUT = 1e-3
#: fields that belong to one process (a log, a clock): not pickled with a hook state
LOCAL_FIELDS = ("monitor", "clock")
#: the search options, once policy options (``policy_options={"search": ...}``): that spelling
#: still works, with a DeprecationWarning
SEARCH_OPTIONS = ("search", "progress", "horizon", "noise", "prefer")


def learning_rate(optimizer: torch.optim.Optimizer | None) -> float | None:
    """The largest learning rate of ``optimizer``'s parameter groups (``None``: no optimizer,
    or a group without one): what the engine tells a controller at each step's start
    (:meth:`gravac.engine.Engine.begin`), which Accordion reads for decays."""
    if optimizer is None or any("lr" not in g for g in optimizer.param_groups):
        return None
    return max(float(g["lr"]) for g in optimizer.param_groups)


def _check_named(value: object, name: str, kind: type, known: list[str]) -> None:
    """``value`` must be a registered name or an instance of ``kind``."""
    if isinstance(value, str):
        return  # the registry checks the name and lists the known ones
    if not isinstance(value, kind):
        raise ValueError(
            f"{name} must be one of {known} or a {kind.__name__} instance, got {value!r}"
        )


def _check_monitor(monitor: object) -> None:
    if not (
        monitor is None
        or hasattr(monitor, "log")
        or hasattr(monitor, "add_scalar")
        or isinstance(monitor, str | os.PathLike)
    ):
        raise ValueError(
            "monitor must be None, a gravac Monitor, a SummaryWriter or a log directory "
            f"(str or path), got {monitor!r}"
        )


def _check_step_timeout(timeout: object) -> None:
    """``timeout`` must be ``None`` or a finite number of seconds >= :data:`MIN_STEP_TIMEOUT`."""
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout < MIN_STEP_TIMEOUT
    ):
        raise ValueError(
            f"step_timeout must be None or a finite number of seconds >= {MIN_STEP_TIMEOUT:g}, "
            f"got {timeout!r}"
        )


@dataclass(frozen=True)
class GravacConfig:
    """The options of gravac's engine, checked when made: a bad value raises ``ValueError``
    naming the field, the value and what is allowed.

    Attributes:
        compressor: a compressor name (:func:`gravac.compressors.names`) or instance.
        compressor_options: keyword options for a compressor given by name.
        policy: a ladder name (:func:`gravac.control.policies.names`: ``"exponential"``,
            ``"geometric"``, ``"fixed"``, ``"accordion"``) or a policy instance.
        policy_options: keyword options for a policy given by name (``{"cf": 100}`` for
            ``"fixed"``, ``{"ratio": 4}`` for a ladder).
        search: how an adaptive ladder's CFs are judged (``"auto"``, ``"shadow"``,
            ``"trial"``, ``"paper"``; :data:`gravac.control.options.SEARCHES`); ``None``:
            ``"auto"``.
        progress, horizon, noise, prefer: options of the searches by trial and shadow
            (``None``: the search's default). The spelling ``policy_options={"search": ...}``
            (and the same for these) still works, with a ``DeprecationWarning``.
        theta_min, theta_max, epsilon, omega, window, warmup_steps, ewma_alpha: the
            controller's hyperparameters (:class:`gravac.control.options.ControllerConfig`
            says what each means and why its default is what it is, and checks the search
            options).
        error_feedback: keep residuals of what was not sent (default) or drop them.
        batch_size: samples per rank per step, for throughput in samples/s; ``None`` measures
            steps/s times the world size (the same ranking of CFs).
        nonfinite: ``"skip"`` (default) skips a step whose gradient holds NaN or Inf on any
            rank, or whose aggregate does, leaving parameters, residuals, controller and
            compressor state untouched (as ``GradScaler`` does); ``"raise"`` raises
            ``FloatingPointError`` on every rank.
        step_timeout: seconds each collective gravac starts (a step's payloads and scalars,
            the statistics some compressors agree, ``sync_buffers``' broadcast) may take from
            its start to its completion, waiting for the other ranks included; past it the step
            raises :class:`gravac.StepTimeoutError` naming the step and the collective, and the
            process can exit at once (the backend fails the collective
            :data:`gravac.comm.BACKEND_MARGIN` later). Set it above the longest a rank may lag
            the others between two steps (evaluation or checkpointing on one rank). ``None``
            (default): the process group's own timeout (30 minutes by default), past which the
            step raises :class:`gravac.CollectiveError`. A rank that dies fails the others'
            step with a :class:`gravac.CollectiveError` either way.
        ranks_per_node: two-level aggregation (:mod:`gravac.hierarchy`): ranks in nodes of
            this many consecutive ranks, a dense reduce-scatter inside each node, the chunks
            compressed and aggregated across nodes, an all-gather inside each node. ``None``
            (default): as torchrun reports the nodes (``LOCAL_WORLD_SIZE``), where it reports
            more than one node of more than one rank, else flat; ``1``: flat (every rank's
            payload aggregated over the whole group); it must divide the world size.
        node_precision: in two levels, what the dense stages inside a node (the reduce-scatter
            and the all-gather) send a compressed unit in: ``"fp32"`` (default, exact),
            ``"fp16"`` or ``"bf16"`` (half the bytes inside the node; the all-gather's rounding
            is fed back into the residual, that of what each rank sends first is not, as under
            PyTorch's fp16 hook; float16 overflows past 65504 times the node's ranks, a
            non-finite step).
        node_stage: in two levels, how those stages move the gradient: ``"shm"`` through a
            file in ``/dev/shm`` that the node's ranks map (on one host, over gloo: the same
            sums as the collectives, without the loopback's TCP), ``"collective"`` through the
            node group's reduce-scatter and all-gather, ``"auto"`` (default) the first where
            every rank of the node can map the file and the backend is gloo, else the second.
        monitor: a :class:`gravac.monitor.Monitor`, a ``SummaryWriter``, or a log directory;
            used on rank 0 only.
        clock: seconds for step timing (tests inject a deterministic one).
    """

    compressor: str | Compressor = "topk"
    compressor_options: Mapping[str, Any] | None = None
    policy: str | ScalingPolicy = "exponential"
    policy_options: Mapping[str, Any] | None = None
    search: str | None = None
    progress: str | None = None
    horizon: int | None = None
    noise: bool | None = None
    prefer: str | None = None
    theta_min: float = ControllerConfig.theta_min
    theta_max: float = ControllerConfig.theta_max
    epsilon: float = ControllerConfig.epsilon
    omega: float = ControllerConfig.omega
    window: int = ControllerConfig.window
    warmup_steps: int = ControllerConfig.warmup_steps
    ewma_alpha: float | None = None
    error_feedback: bool = True
    batch_size: int | None = None
    nonfinite: str = "skip"
    step_timeout: float | None = None
    ranks_per_node: int | None = None
    node_precision: str = "fp32"
    node_stage: str = "auto"
    monitor: Any = field(default=None, compare=False)
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False)

    def __post_init__(self) -> None:
        _check_named(self.compressor, "compressor", Compressor, compressors.names())
        _check_named(self.policy, "policy", ScalingPolicy, policies.names())
        for label, options in (
            ("compressor_options", self.compressor_options),
            ("policy_options", self.policy_options),
        ):
            if options is not None and not isinstance(options, Mapping):
                raise ValueError(
                    f"{label} must be a dict of keyword options or None, got {options!r}"
                )
        for name in SEARCH_OPTIONS:
            if getattr(self, name) is not None and name in (self.policy_options or {}):
                raise ValueError(
                    f"{name} is given twice: as {name} and in policy_options; pass {name} alone"
                )
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        _check_monitor(self.monitor)
        if self.nonfinite not in NONFINITE_CHOICES:
            raise ValueError(
                f"nonfinite must be one of {NONFINITE_CHOICES}, got {self.nonfinite!r}"
            )
        b = self.batch_size
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"batch_size must be None or an integer >= 1, got {b!r}")
        _check_step_timeout(self.step_timeout)
        r = self.ranks_per_node
        if r is not None and not (is_integer(r) and r >= 1):
            raise ValueError(f"ranks_per_node must be None or an integer >= 1, got {r!r}")
        if self.node_precision not in NODE_PRECISIONS:
            raise ValueError(
                f"node_precision must be one of {tuple(NODE_PRECISIONS)}, "
                f"got {self.node_precision!r}"
            )
        if self.node_stage not in NODE_STAGES:
            raise ValueError(f"node_stage must be one of {NODE_STAGES}, got {self.node_stage!r}")
        if not isinstance(self.compressor, str) and self.compressor_options:
            raise ValueError("compressor_options go with a compressor name, not an instance")
        if not isinstance(self.policy, str) and self.policy_options:
            raise ValueError("policy_options go with a policy name, not an instance")
        self.controller_config()  # checks the hyperparameters and the search options

    def controller_config(self) -> ControllerConfig:
        """The controller's hyperparameters and search options (the fields of this config
        that it has; a search option still given as a policy option counts as given here)."""
        legacy = {k: v for k, v in (self.policy_options or {}).items() if k in SEARCH_OPTIONS}
        names = (f.name for f in dataclasses.fields(ControllerConfig))
        values = {name: legacy.get(name, getattr(self, name)) for name in names}
        values["search"] = values["search"] or "auto"
        return ControllerConfig(**values)

    def make_compressor(self) -> Compressor:
        """The compressor: the instance given, or a new one built by name."""
        if isinstance(self.compressor, str):
            return compressors.create(self.compressor, **(self.compressor_options or {}))
        return self.compressor

    def make_policy(self) -> ScalingPolicy:
        """The policy: the instance given, or a new one built by name with its options (but
        the search options, which :meth:`controller_config` takes)."""
        if not isinstance(self.policy, str):
            return self.policy
        options = dict(self.policy_options or {})
        legacy = [k for k in SEARCH_OPTIONS if k in options]
        if legacy:
            spelled = ", ".join(f"{k}=..." for k in legacy)
            warnings.warn(
                f"policy_options={{{', '.join(repr(k) + ': ...' for k in legacy)}}} is "
                f"deprecated: pass {spelled} to gravac (GravacOptimizer, GravacHookState, "
                "GravacConfig) instead",
                DeprecationWarning,
                stacklevel=4,
            )
        return policies.create(self.policy, **{k: v for k, v in options.items() if k not in legacy})

    def options(self, *, local: bool = True) -> dict[str, Any]:
        """The fields as keyword options (without :data:`LOCAL_FIELDS` unless ``local``)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if local or f.name not in LOCAL_FIELDS
        }


def make_config(config: GravacConfig | None = None, **options: Any) -> GravacConfig:
    """``config`` (default: :class:`GravacConfig`'s defaults) with keyword ``options``
    replacing its fields, checked.

    Raises:
        ValueError: ``config`` is not a :class:`GravacConfig`, or an option is not valid.
        TypeError: an option is not a field of :class:`GravacConfig`.
    """
    if not isinstance(config, GravacConfig | None):
        raise ValueError(f"config must be a GravacConfig or None, got {config!r}")
    config = config or GravacConfig()
    return dataclasses.replace(config, **options) if options else config


def build_engine(
    process_group: dist.ProcessGroup | None = None,
    config: GravacConfig | None = None,
    **options: Any,
) -> Engine:
    """The engine of ``config`` (default: :class:`GravacConfig`'s defaults) in
    ``process_group``; keyword ``options`` replace the config's fields.

    Raises:
        ValueError: an option is not valid; the message names it, its value and what is
            allowed.
    """
    config = make_config(config, **options)
    compressor = config.make_compressor()
    return Engine(
        compressor,
        config.make_policy(),
        config.controller_config(),
        compressor.make_memory() if config.error_feedback else NoMemory(),
        Communicator(process_group, timeout=config.step_timeout),
        batch_size=config.batch_size,
        nonfinite=config.nonfinite,
        ranks_per_node=config.ranks_per_node,
        node_precision=config.node_precision,
        node_stage=config.node_stage,
        monitor=config.monitor,
        clock=config.clock,
    )
