"""The options both front ends share, validated once, and the engine built from them.

:class:`gravac.GravacOptimizer` and :class:`gravac.ddp.GravacHookState` take the same
compression and controller options; :func:`build_engine` checks each (a clear error naming the
option, its value and what is allowed) and builds the :class:`gravac.engine.Engine`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gravac import compressors
from gravac.comm import Communicator
from gravac.compressors.base import Compressor
from gravac.control import policies
from gravac.control.controller import ControllerConfig
from gravac.control.policies.base import ScalingPolicy
from gravac.engine import Engine
from gravac.memory import NoMemory

__all__ = ["NONFINITE_CHOICES", "build_engine", "learning_rate"]

#: what a non-finite gradient or aggregate does: skip the step on every rank, or raise
NONFINITE_CHOICES = ("skip", "raise")


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


def build_engine(
    process_group: dist.ProcessGroup | None = None,
    *,
    compressor: str | Compressor = "topk",
    policy: str | ScalingPolicy = "exponential",
    theta_min: float = ControllerConfig.theta_min,
    theta_max: float = ControllerConfig.theta_max,
    epsilon: float = ControllerConfig.epsilon,
    omega: float = ControllerConfig.omega,
    window: int = ControllerConfig.window,
    warmup_steps: int = ControllerConfig.warmup_steps,
    ewma_alpha: float | None = None,
    compressor_options: dict[str, Any] | None = None,
    policy_options: dict[str, Any] | None = None,
    error_feedback: bool = True,
    batch_size: int | None = None,
    nonfinite: str = "skip",
    monitor: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Engine:
    """Validate the shared options and build the engine (see :class:`gravac.GravacOptimizer`
    for what each means).

    Raises:
        ValueError: an option is not valid; the message names it, its value and what is
            allowed.
    """
    _check_named(compressor, "compressor", Compressor, compressors.names())
    _check_named(policy, "policy", ScalingPolicy, policies.names())
    for label, options in (
        ("compressor_options", compressor_options),
        ("policy_options", policy_options),
    ):
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"{label} must be a dict of keyword options or None, got {options!r}")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
    _check_monitor(monitor)
    if nonfinite not in NONFINITE_CHOICES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_CHOICES}, got {nonfinite!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or an integer >= 1, got {batch_size!r}")
    if isinstance(compressor, str):
        compressor = compressors.create(compressor, **(compressor_options or {}))
    elif compressor_options:
        raise ValueError("compressor_options go with a compressor name, not an instance")
    if isinstance(policy, str):
        policy = policies.create(policy, **(policy_options or {}))
    elif policy_options:
        raise ValueError("policy_options go with a policy name, not an instance")
    config = ControllerConfig(
        theta_min=theta_min,
        theta_max=theta_max,
        epsilon=epsilon,
        omega=omega,
        window=window,
        warmup_steps=warmup_steps,
        ewma_alpha=ewma_alpha,
    )
    return Engine(
        compressor,
        policy,
        config,
        compressor.make_memory() if error_feedback else NoMemory(),
        Communicator(process_group),
        batch_size=batch_size,
        nonfinite=nonfinite,
        monitor=monitor,
        clock=clock,
    )
