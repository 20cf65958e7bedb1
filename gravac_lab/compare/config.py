"""The configuration of a ``gravac compare`` run: every option, checked before any worker starts.

:class:`CompareConfig` is a frozen record validated in ``__post_init__`` (messages name the
command-line option), and against what each of its modes needs by
:func:`gravac_lab.compare.modes.check_config` (the study checks it); it travels to the workers as
JSON (:meth:`CompareConfig.to_json`), so every worker runs exactly what the command line asked for.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from gravac.control.options import ControllerConfig
from gravac_lab.compare import workloads
from gravac_lab.compare.layout import DEFAULT_WORKERS, MIN_WORKERS, NodeLayout
from gravac_lab.compare.netns import parse_delay, parse_rate

__all__ = [
    "ADAM_LR",
    "DEFAULT_EVAL_EVERY",
    "DEFAULT_LINK_TEST_MB",
    "DEFAULT_LR_GAMMA",
    "DEFAULT_MODES",
    "DEFAULT_STEPS",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TIMING_WARMUP",
    "MIN_POWERSGD_START",
    "OPTIMIZERS",
    "QUICK_EVAL_EVERY",
    "QUICK_LINK_TEST_MB",
    "QUICK_MODES",
    "QUICK_STEPS",
    "STOP_HOLD",
    "CompareConfig",
]

#: the modes a plain ``gravac compare`` runs, one after another
DEFAULT_MODES = ("ddp", "ddp-fp16", "ddp-powersgd", "gravac")
#: training steps of a full run: DDP's float32 all-reduce brings the VGG workload to 0.95 test
#: accuracy in about 60 steps; the compressed modes need more
DEFAULT_STEPS = 300
#: steps between test evaluations (rank 0, off the training clock)
DEFAULT_EVAL_EVERY = 10
#: first steps left out of the per-step medians (allocations, DDP's bucket rebuild after
#: step 1, gloo's first connections)
DEFAULT_TIMING_WARMUP = 5
#: seconds a job (one mode, or the link test) may take before its workers are killed
DEFAULT_TIMEOUT = 900.0
#: MiB all-reduced to measure a shaped link's throughput
DEFAULT_LINK_TEST_MB = 64
#: evaluations in a row at ``--stop-at`` that end a run: the first at the value, and the next
#: one confirming it (the scoreboard's hold: a single lucky evaluation does not count)
STOP_HOLD = 2
#: ``--quick``: the modes, steps, evaluation interval and link test of a CI smoke run, on the
#: tiny workload: 20 steps of a few milliseconds check the machinery, not the model (its test
#: accuracy is still below 0.2)
QUICK_MODES = ("ddp", "ddp-fp16", "gravac")
QUICK_STEPS = 20
QUICK_EVAL_EVERY = 10
QUICK_LINK_TEST_MB = 8
#: the factor of each learning-rate decay at a milestone (``--lr-gamma``): a tenth, as the
#: step decays of ResNet's and VGG's training recipes
DEFAULT_LR_GAMMA = 0.1
#: the optimizers every mode can train with (``--optimizer``): SGD with momentum, or Adam (the
#: adaptive method CLAN / BytePS-Compress compress for), both torch's
OPTIMIZERS = ("sgd", "adam")
#: Adam's learning rate unless ``--lr`` says otherwise: torch's and Kingma and Ba's default (the
#: workloads' rates are SGD's)
ADAM_LR = 1e-3
#: torch's PowerSGD needs ``start_powerSGD_iter`` > 1 with error feedback or warm start (on)
MIN_POWERSGD_START = 2


def _positive_int(option: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{option} must be an integer >= {minimum}, got {value!r}")


def _finite(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{option} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CompareConfig:
    """What one ``gravac compare`` run measures (each field is the option of the same name).

    Attributes:
        modes: the modes to run, one after another, each on the same seeds.
        workload: a name in :data:`gravac_lab.compare.workloads.WORKLOADS`.
        workers: processes, each with its own shard of the training set.
        nodes: the nodes the workers are grouped into, ``workers / nodes`` consecutive ranks
            each (:mod:`gravac_lab.compare.layout`): with shaped links, one network namespace
            per node, the links between them shaped; 1 (default): flat, every worker behind a
            link of its own.
        steps: training steps of every mode.
        batch_size: samples per worker per step.
        optimizer: what every mode trains with, of :data:`OPTIMIZERS` (gravac's modes wrap it).
        lr: the optimizer's learning rate (``None``: the workload's, :attr:`Workload.lr`, for
            SGD; :data:`ADAM_LR` for Adam).
        lr_milestones: steps after which the learning rate is multiplied by ``lr_gamma`` (a
            step decay, :class:`torch.optim.lr_scheduler.MultiStepLR`), increasing; empty: a
            constant rate.
        lr_gamma: the factor of each decay, in (0, 1].
        momentum: SGD's (Adam keeps torch's betas).
        eval_every: steps between test evaluations on rank 0 (the last step always is one).
        timing_warmup: first steps left out of the per-step medians.
        target: metric value the time-to-target clock stops at (``None``: the workload's).
        threads: torch intra-op threads per worker.
        compressor, compressor_options, policy, policy_options, theta_min, theta_max: the
            gravac modes' compression options (as :class:`gravac.GravacOptimizer` takes them);
            a study's variants (:class:`gravac_lab.compare.study.Variant`) replace the first four
            in each of their jobs' configurations.
        engine_options: more keyword options of the gravac modes' optimizer or hook state, of
            :data:`gravac_lab.compare.modes.ENGINE_OPTIONS` (``{"error_feedback": false}``); a
            study's variants replace them too.
        overlap: the gravac mode's ``overlap`` option, where its optimizer has one.
        bucket_view: DDP's ``gradient_as_bucket_view`` in every mode that runs DDP (the
            gradients are views of DDP's buckets: no copy of a bucket's result into them
            where the hook returns the bucket itself, as the all-reduce, fp16 and gravac hooks
            do).
        powersgd_rank, powersgd_start: PowerSGD's ``matrix_approximation_rank`` and
            ``start_powerSGD_iter``.
        bandwidth: link rate as ``tc`` writes it (``1gbit``); ``None``: loopback.
        delay: one-way link delay (``1ms``); needs ``bandwidth``.
        link_test_mb: MiB all-reduced to measure a shaped link (0: no measurement).
        stop_at: stop a run once its metric has met this value (at or above an accuracy, at or
            below a perplexity) at :data:`STOP_HOLD` evaluations in a row, as a user who
            trains to a quality would; ``None``: every run trains all its steps.
        timeout: seconds one job may take before its workers are killed.
        seed: offsets the seeds of the initial weights and of every rank's batches (runs
            with different seeds measure the spread; a study's ``--seeds`` set it per job).
        batches: which of a seed's batch orders every rank draws: 0, the seed's own; another
            draws other batches from the same shard with the same initial weights (the
            scoreboard's twins, :data:`gravac_lab.compare.scoreboard.TWIN_BATCHES`).
    """

    modes: tuple[str, ...] = DEFAULT_MODES
    workload: str = workloads.DEFAULT_WORKLOAD
    workers: int = DEFAULT_WORKERS
    nodes: int = 1
    steps: int = DEFAULT_STEPS
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float | None = None
    lr_milestones: tuple[int, ...] = ()
    lr_gamma: float = DEFAULT_LR_GAMMA
    momentum: float = 0.9
    eval_every: int = DEFAULT_EVAL_EVERY
    timing_warmup: int = DEFAULT_TIMING_WARMUP
    target: float | None = None
    threads: int = 1
    compressor: str = "topk"
    compressor_options: dict[str, Any] = field(default_factory=dict)
    policy: str = "exponential"
    policy_options: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    theta_min: float = ControllerConfig.theta_min
    theta_max: float = ControllerConfig.theta_max
    overlap: bool = True
    bucket_view: bool = True
    powersgd_rank: int = 4
    powersgd_start: int = 10
    bandwidth: str | None = None
    delay: str | None = None
    link_test_mb: int = DEFAULT_LINK_TEST_MB
    stop_at: float | None = None
    timeout: float = DEFAULT_TIMEOUT
    seed: int = 0
    batches: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", tuple(self.modes))  # a list, coming from JSON
        object.__setattr__(self, "lr_milestones", tuple(self.lr_milestones))
        if not self.modes:
            raise ValueError("--modes must name at least one mode")
        duplicates = sorted({m for m in self.modes if self.modes.count(m) > 1})
        if duplicates:
            raise ValueError(f"--modes names {duplicates} more than once")
        workloads.get(self.workload)
        _positive_int("--workers", self.workers, minimum=MIN_WORKERS)
        NodeLayout.of_options(workers=self.workers, nodes=self.nodes, ranks_per_node=None)
        for option in ("steps", "batch_size", "eval_every", "threads", "powersgd_rank"):
            _positive_int(f"--{option.replace('_', '-')}", getattr(self, option))
        _positive_int("--timing-warmup", self.timing_warmup, minimum=0)
        _positive_int("--link-test-mb", self.link_test_mb, minimum=0)
        _positive_int("--seed", self.seed, minimum=0)
        _positive_int("batches", self.batches, minimum=0)
        _positive_int("--powersgd-start", self.powersgd_start, minimum=MIN_POWERSGD_START)
        if self.steps <= self.timing_warmup:
            raise ValueError(
                f"--steps ({self.steps}) must exceed --timing-warmup ({self.timing_warmup})"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"--optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.lr is not None and _finite("--lr", self.lr) <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        for m in self.lr_milestones:
            _positive_int("--lr-milestones", m)
        if list(self.lr_milestones) != sorted(set(self.lr_milestones)):
            raise ValueError(f"--lr-milestones must increase, got {list(self.lr_milestones)}")
        if not 0 < _finite("--lr-gamma", self.lr_gamma) <= 1:
            raise ValueError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if not 0 <= _finite("--momentum", self.momentum) < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.target is not None:
            _check_target("--target", self.target, workloads.get(self.workload))
        if self.stop_at is not None:
            _check_target("--stop-at", self.stop_at, workloads.get(self.workload))
        if _finite("--timeout", self.timeout) <= 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        for option, value in (
            ("--compressor-options", self.compressor_options),
            ("--policy-options", self.policy_options),
            ("--engine-options", self.engine_options),
        ):
            if not isinstance(value, dict):
                raise ValueError(f"{option} must be a JSON object, got {value!r}")
        if self.bandwidth is not None:
            parse_rate(self.bandwidth)
        if self.delay is not None:
            if self.bandwidth is None:
                raise ValueError("--delay needs --bandwidth (links are only made with a rate)")
            parse_delay(self.delay)

    @property
    def layout(self) -> NodeLayout:
        """The workers in their nodes."""
        return NodeLayout(self.nodes, self.workers // self.nodes)

    @property
    def rate_bits(self) -> int | None:
        """``bandwidth`` in bits/s, or ``None`` (loopback)."""
        return None if self.bandwidth is None else parse_rate(self.bandwidth)

    @property
    def delay_seconds(self) -> float:
        """``delay`` in seconds (0 without one)."""
        return 0.0 if self.delay is None else parse_delay(self.delay)

    @property
    def lr_value(self) -> float:
        """The optimizer's learning rate: ``lr``, or the workload's for SGD, :data:`ADAM_LR`
        for Adam."""
        if self.lr is not None:
            return self.lr
        return ADAM_LR if self.optimizer == "adam" else workloads.get(self.workload).lr

    @property
    def target_value(self) -> float:
        """The time-to-target threshold: ``target``, or the workload's."""
        return workloads.get(self.workload).target if self.target is None else self.target

    def resolved(self) -> dict[str, Any]:
        """Every field, with ``lr`` resolved to the learning rate used (for reports)."""
        return {**asdict(self), "lr": self.lr_value}

    def to_json(self) -> str:
        """Every field, as JSON (:meth:`from_json` rebuilds the same configuration)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CompareConfig:
        """The configuration :meth:`to_json` wrote (checked again)."""
        return cls(**json.loads(text))


def _check_target(option: str, target: float, workload: workloads.Workload) -> None:
    """A value of the workload's metric that ``option`` gives: an accuracy in (0, 1], a
    perplexity > 1.

    Raises:
        ValueError: naming ``option``, the value and the metric's range.
    """
    _finite(option, target)
    accuracy = workload.higher_is_better
    if (accuracy and not 0 < target <= 1) or (not accuracy and target <= 1):
        allowed = "an accuracy in (0, 1]" if accuracy else "a perplexity > 1"
        raise ValueError(
            f"{option} must be {allowed} for {workload.name}'s {workload.metric_name}, "
            f"got {target:g}"
        )
