"""How a ``gravac compare`` mode exchanges gradients: DDP, its compression hooks, or gravac.

A :class:`Mode` checks that it can run with a configuration (:meth:`Mode.check`, before any
worker starts) and, inside a worker, wraps the freshly built model (:meth:`Mode.open`) in a
:class:`Session`: the module the forward pass goes through, the optimizer, and after each step
the :class:`StepFigures` the mode knows of (bytes sent; compression and communication seconds
where the mode measures them; the CF sent where the mode decides one). :data:`MODES` maps
names to modes; :attr:`Mode.takes_variants` marks the modes a study runs once per gravac
variant.

=================  ================================================================  ===========
mode               what                                                              wire bytes
=================  ================================================================  ===========
``ddp``            ``DistributedDataParallel``, float32 all-reduce                   4 per param
``ddp-fp16``       DDP + ``fp16_compress_hook``                                      2 per param
``ddp-powersgd``   DDP + ``powerSGD_hook`` (one bucket on gloo, see below)           torch's count
``gravac``         :class:`gravac.GravacOptimizer` around SGD, plain model           last_record
``gravac-ddp``     DDP + :func:`gravac.ddp.gravac_hook`                              last_record
=================  ================================================================  ===========

Wire bytes are what one rank puts into the collectives per step, the measure gravac's
``StepRecord.wire_bytes`` uses (a ring all-reduce moves ``2 (n - 1) / n`` times that over each
link). DDP all-reduces every parameter's gradient once a step, so its bytes follow from the
parameter count exactly; PowerSGD's come from the elements torch's hook counts after
compression (``PowerSGDState.total_numel_after_compression``), and the float32 all-reduce of
every parameter before ``start_powerSGD_iter``.

.. note:: **PowerSGD on gloo needs a single DDP bucket.** torch's ``powerSGD_hook`` launches
   only a bucket's first all-reduce from the hook; the all-reduces of P and Q are launched from
   ``Future.then`` callbacks, which gloo runs on its worker threads when the previous
   collective completes, and which block there in ``.wait()``. With two or more buckets,
   those launches race DDP's launch of the next bucket from the autograd thread, so ranks
   issue their collectives in different orders: gloo pairs collectives by issue order and
   aborts with "Received data size doesn't match expected size" (or both of its worker threads
   block in nested waits and the step hangs). It starts exactly at ``start_powerSGD_iter``,
   because the vanilla all-reduce before it is a single collective launched from the autograd
   thread. It reproduces with plain torch (2.13) and no gravac code on this model, which has
   two buckets under DDP's defaults (a first bucket of 1 MiB, then 25 MiB). None of
   ``use_error_feedback``, ``warm_start``, ``batch_tensors_with_same_shape`` or DDP's
   ``gradient_as_bucket_view`` changes how the collectives are launched, and none helps;
   ``bucket_cap_mb`` at least the model's gradient size (one bucket, which the explicit
   value also gives the first bucket) makes the chain of collectives sequential and works.
   So ``ddp-powersgd`` runs with one bucket, which gives up overlapping the all-reduce with
   backward, and says so in its options.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gravac import compressors, policies
from gravac.buckets import check_bytes
from gravac.config import SEARCH_OPTIONS, GravacConfig, build_engine
from gravac.control.options import ControllerConfig
from gravac.ddp import GravacHookState, gravac_hook
from gravac.optimizer import GravacOptimizer, broadcast_parameters
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.workloads import parameter_count

if TYPE_CHECKING:
    from gravac.engine import Engine

__all__ = [
    "ENGINE_OPTIONS",
    "FLOAT16_BYTES",
    "FLOAT32_BYTES",
    "MODES",
    "NODE_STAGE",
    "RANKS_PER_NODE",
    "Mode",
    "Session",
    "StepFigures",
    "check_config",
    "check_engine_options",
    "check_registered",
    "get",
    "names",
    "split_search",
]

#: bytes of a float32 and a float16 element on the wire
FLOAT32_BYTES = 4
FLOAT16_BYTES = 2
#: bytes in DDP's ``bucket_cap_mb`` unit (MiB)
_MIB = 2**20
#: seed of PowerSGD's random initial factors (torch's default), the same on every rank
POWERSGD_SEED = 0
#: the optimizer's options a configuration or a variant may set beside the compressor, the
#: policy and the CF range (the controller's, error feedback, what a non-finite gradient does,
#: two-level aggregation's nodes, the precision and the stage inside them, the bucket size:
#: the gravac-ddp mode's DDP takes it as its ``bucket_cap_mb``)
ENGINE_OPTIONS = (
    "error_feedback",
    "epsilon",
    "omega",
    "window",
    "warmup_steps",
    "ewma_alpha",
    "nonfinite",
    "ranks_per_node",
    "node_precision",
    "node_stage",
    "bucket_bytes",
)
#: the one option of ENGINE_OPTIONS that the optimizer takes and the engine does not
_BUCKET_BYTES = "bucket_bytes"
#: the option of ENGINE_OPTIONS that moves a node's stages through shared memory or collectives
NODE_STAGE = "node_stage"
#: the option of ENGINE_OPTIONS that groups the ranks into nodes for two-level aggregation
#: (``gravac.hierarchy``; ``gravac compare --nodes`` emulates the nodes)
RANKS_PER_NODE = "ranks_per_node"


def _split_bucket_bytes(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``options``' bucket size (``None``: not given) and the rest, the engine's own."""
    rest = dict(options)
    return rest.pop(_BUCKET_BYTES, None), rest


@dataclass(frozen=True)
class StepFigures:
    """What a mode knows of one step on this rank.

    Attributes:
        wire_bytes: bytes this rank put into the collectives.
        compress_seconds: seconds compressing, where the mode measures it.
        comm_seconds: seconds of communication not hidden behind backward, where the mode
            measures it (gravac's ``StepRecord.comm_seconds``).
        cf_sent: the compression factor the step sent at, where the mode decides one
            (gravac's ``StepRecord.cf_sent``; 1 for dense); ``None`` for DDP's modes and for a
            step gravac skipped.
        cf_achieved: the compression factor the compressor delivered (gravac's
            ``StepRecord.cf_achieved``), where the mode knows it.
        gain_step: the step's compression gain of what it sent (gravac's
            ``StepRecord.gain_min_step``), where it was measured.
        gain_window: the gain of the window that ended before the step (gravac's
            ``StepRecord.gain_window``), at the steps that carry one.
        gain_shadow: the shadow window gains of that window by CF (``StepRecord.gain_shadow``,
            the search by shadow), at the steps that carry them.
        signal: the signal share of that window's gradient (``StepRecord.signal``, the search
            by shadow), at the steps that carry one.
        judged: by CF, ``[judged gain, estimated samples/s]`` that the search by shadow chose
            the next window's CF by (``StepRecord.judged``; ``None`` for a value it did not
            know), at the steps that chose one.
    """

    wire_bytes: int
    compress_seconds: float | None = None
    comm_seconds: float | None = None
    cf_sent: float | None = None
    cf_achieved: float | None = None
    gain_step: float | None = None
    gain_window: float | None = None
    gain_shadow: dict[str, float] | None = None
    signal: float | None = None
    judged: dict[str, list[float | None]] | None = None


class Session(ABC):
    """A mode running in one worker: the module to train through and its optimizer."""

    #: the module the forward pass goes through (DDP's wrapper, or the model itself)
    module: nn.Module
    #: the optimizer to ``zero_grad`` and ``step``
    optimizer: torch.optim.Optimizer

    @abstractmethod
    def after_step(self) -> StepFigures:
        """The figures of the step that ``optimizer.step()`` just finished."""

    def options(self) -> dict[str, Any]:
        """What the mode ran with beyond the configuration, for the report."""
        return {}

    def close(self) -> None:  # noqa: B027 - most sessions hold nothing to release
        """Release what the session holds (collective where the mode's is)."""


def _optimizer(model: nn.Module, cfg: CompareConfig) -> torch.optim.Optimizer:
    """The optimizer every mode trains with (``--optimizer``): SGD with momentum, or Adam."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr_value)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr_value, momentum=cfg.momentum)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def check_registered(
    registry: Any, name: str, options: dict[str, Any], *, name_option: str, options_option: str
) -> None:
    """Build ``name`` from ``registry`` (:mod:`gravac.compressors` or
    :mod:`gravac.control.policies`) with ``options`` once, and raise ``ValueError`` naming
    ``name_option`` for an unknown name and ``options_option`` for options that do not fit it."""
    if name not in registry.names():
        raise ValueError(f"{name_option} must be one of {registry.names()}, got {name!r}")
    try:
        registry.create(name, **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{options_option} {options} do not fit {name!r}: {exc}") from None


def check_engine_options(options: dict[str, Any], gravac: dict[str, Any], *, option: str) -> None:
    """Reject engine options (``option`` names where they were given) that are not of
    :data:`ENGINE_OPTIONS` or that the optimizer refuses beside ``gravac``, the compressor and
    policy options they go with (the optimizer's own checks, on one rank, no process group)."""
    if not options:
        return
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise ValueError(
            f"{option} {options} has no option {unknown[0]!r}; allowed: {list(ENGINE_OPTIONS)}"
        )
    bucket_bytes, engine = _split_bucket_bytes(options)
    try:
        check_bytes(_BUCKET_BYTES, bucket_bytes, optional=True, least=1)
        build_engine(None, GravacConfig(**gravac, **engine))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{option} {options} do not fit: {exc}") from None


def split_search(policy_options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A variant's policy options without the search options, and the search options
    (:data:`gravac.config.SEARCH_OPTIONS`): the variants spell both as policy options
    (``topk:exponential{"search": "trial"}``)."""
    search = {k: v for k, v in policy_options.items() if k in SEARCH_OPTIONS}
    return {k: v for k, v in policy_options.items() if k not in search}, search


def _check_gravac_options(cfg: CompareConfig) -> None:
    """Reject compressor, policy, engine and CF-range options before any worker starts."""
    ladder_options, search = split_search(cfg.policy_options)
    for option, registry, name, kwargs in (
        ("--compressor-options", compressors, cfg.compressor, cfg.compressor_options),
        ("--policy-options", policies, cfg.policy, ladder_options),
    ):
        check_registered(
            registry,
            name,
            kwargs,
            name_option=option.removesuffix("-options"),
            options_option=option,
        )
    try:
        ControllerConfig(theta_min=cfg.theta_min, theta_max=cfg.theta_max, **search)
    except ValueError as exc:
        raise ValueError(f"--{str(exc).replace('_', '-')}") from None
    check_engine_options(cfg.engine_options, _gravac_options(cfg), option="--engine-options")
    ranks_per_node = cfg.engine_options.get(RANKS_PER_NODE)
    if isinstance(ranks_per_node, int) and ranks_per_node >= 1 and cfg.workers % ranks_per_node:
        raise ValueError(
            f"--engine-options {RANKS_PER_NODE} {ranks_per_node} must divide the {cfg.workers} "
            f"workers (--workers, or --nodes x --ranks-per-node)"
        )


class Mode(ABC):
    """A way of exchanging gradients; see the module docstring for the list."""

    #: the ``--modes`` name
    name: ClassVar[str]
    #: one line for ``--help``
    summary: ClassVar[str]
    #: whether :class:`StepFigures` carries the communication time ("record"), or the report
    #: derives it as forward + backward time beyond the bare model's ("exposed")
    comm_source: ClassVar[str] = "exposed"
    #: whether the mode runs gravac's compressor and policy, so that a study runs it once per
    #: variant (:mod:`gravac_lab.compare.study`)
    takes_variants: ClassVar[bool] = False
    #: whether the mode trains through ``DistributedDataParallel`` (and so takes the
    #: configuration's ``bucket_view``)
    runs_ddp: ClassVar[bool] = False

    def check(self, cfg: CompareConfig) -> None:  # noqa: B027 - most modes run anywhere
        """Raise ``ValueError`` naming the option if this mode cannot run with ``cfg``."""

    def timed_from(self, cfg: CompareConfig) -> int:
        """The first step whose time counts towards the medians (0-based)."""
        return cfg.timing_warmup

    @abstractmethod
    def open(self, model: nn.Module, cfg: CompareConfig) -> Session:
        """Wrap ``model`` (built identically on every rank) for training in this mode."""


def _ddp(model: nn.Module, cfg: CompareConfig, **options: Any) -> DistributedDataParallel:
    """``model`` in DDP with the configuration's ``gradient_as_bucket_view``."""
    return DistributedDataParallel(model, gradient_as_bucket_view=cfg.bucket_view, **options)


class _DdpSession(Session):
    """DDP with an optional comm hook; a fixed number of bytes per element every step."""

    def __init__(
        self,
        model: nn.Module,
        cfg: CompareConfig,
        *,
        element_bytes: int,
        hook: Any = None,
    ) -> None:
        self.module = _ddp(model, cfg)
        if hook is not None:
            self.module.register_comm_hook(None, hook)  # state: the default process group
        self.optimizer = _optimizer(model, cfg)
        self._wire_bytes = parameter_count(model) * element_bytes

    def after_step(self) -> StepFigures:
        return StepFigures(self._wire_bytes)


class DdpMode(Mode):
    name = "ddp"
    runs_ddp = True
    summary = "DistributedDataParallel, float32 all-reduce"

    def open(self, model: nn.Module, cfg: CompareConfig) -> Session:
        return _DdpSession(model, cfg, element_bytes=FLOAT32_BYTES)


class DdpFp16Mode(Mode):
    name = "ddp-fp16"
    runs_ddp = True
    summary = "DDP + fp16_compress_hook"

    def open(self, model: nn.Module, cfg: CompareConfig) -> Session:
        return _DdpSession(
            model, cfg, element_bytes=FLOAT16_BYTES, hook=default_hooks.fp16_compress_hook
        )


class _PowerSgdSession(Session):
    def __init__(self, model: nn.Module, cfg: CompareConfig) -> None:
        self._numel = parameter_count(model)
        # one bucket: torch's hook mis-orders gloo collectives across buckets (module docs)
        self._bucket_cap_mb = math.ceil(self._numel * FLOAT32_BYTES / _MIB) + 1
        self.module = _ddp(model, cfg, bucket_cap_mb=self._bucket_cap_mb)
        self.state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start,
            random_seed=POWERSGD_SEED,
        )
        self.module.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)
        self.optimizer = _optimizer(model, cfg)
        self._counted = 0

    def after_step(self) -> StepFigures:
        counted = self.state.total_numel_after_compression
        # steps before start_powerSGD_iter all-reduce every element and leave the count alone
        sent = counted - self._counted or self._numel
        self._counted = counted
        return StepFigures(sent * FLOAT32_BYTES)

    def options(self) -> dict[str, Any]:
        return {
            "bucket_cap_mb": self._bucket_cap_mb,
            "buckets": "one (torch's powerSGD_hook mis-orders gloo collectives across buckets)",
        }


class DdpPowerSgdMode(Mode):
    name = "ddp-powersgd"
    runs_ddp = True
    summary = "DDP + PyTorch's powerSGD_hook, one bucket"

    def check(self, cfg: CompareConfig) -> None:
        if cfg.steps <= cfg.powersgd_start:
            raise ValueError(
                f"--steps ({cfg.steps}) must exceed --powersgd-start ({cfg.powersgd_start}) for "
                "ddp-powersgd, or PowerSGD never runs"
            )

    def timed_from(self, cfg: CompareConfig) -> int:
        # the steps before start_powerSGD_iter are plain all-reduces, not PowerSGD
        return max(cfg.timing_warmup, cfg.powersgd_start)

    def open(self, model: nn.Module, cfg: CompareConfig) -> Session:
        return _PowerSgdSession(model, cfg)


def _gravac_options(cfg: CompareConfig) -> dict[str, Any]:
    """The fields of the :class:`gravac.GravacConfig` that GravacOptimizer and GravacHookState
    share (batch size per rank: gravac's throughput is in samples/s), without the engine
    options."""
    policy_options, search = split_search(cfg.policy_options)
    return {
        "compressor": cfg.compressor,
        "compressor_options": cfg.compressor_options or None,
        "policy": cfg.policy,
        "policy_options": policy_options or None,
        **search,
        "theta_min": cfg.theta_min,
        "theta_max": cfg.theta_max,
        "batch_size": cfg.batch_size,
    }


def _figures(record: Any) -> StepFigures:
    if record is None:
        raise RuntimeError("gravac left no last_record after the step")
    return StepFigures(
        int(record.wire_bytes),
        _finite(float(record.compress_seconds)),
        _finite(float(record.comm_seconds)),
        _finite(float(record.cf_sent)),
        _finite(float(record.cf_achieved)),
        _finite(float(record.gain_min_step)),
        None if record.gain_window is None else _finite(float(record.gain_window)),
        {f"{cf:g}": g for cf, g in record.gain_shadow if math.isfinite(g)} or None,
        None if record.signal is None else _finite(float(record.signal)),
        {f"{cf:g}": [_finite(g), _finite(t)] for cf, g, t in record.judged} or None,
    )


def _memory(engine: Engine) -> str:
    """The error-feedback memory the engine keeps (``NoMemory``: none)."""
    return type(engine.memory).__name__


def _topology(engine: Engine) -> dict[str, Any]:
    """The nodes the engine aggregated in: its ``ranks_per_node`` (1: flat), the topology in
    words, and in two levels how the node's stages moved the gradient (``node_stage``: what
    ran, ``"shm"`` or ``"collective"``, after any fallback of ``"auto"``)."""
    topology = engine.topology
    flat = {RANKS_PER_NODE: topology.ranks_per_node, "topology": str(topology)}
    if engine.hierarchy is None:
        return flat
    stage = "shm" if engine.hierarchy.shared is not None else "collective"
    return {**flat, "topology": f"{topology}, node stage {stage}", NODE_STAGE: stage}


class _GravacSession(Session):
    def __init__(self, model: nn.Module, cfg: CompareConfig) -> None:
        broadcast_parameters(model)
        self._overlap = cfg.overlap
        self.module = model
        bucket_bytes, engine = _split_bucket_bytes(cfg.engine_options)
        config = GravacConfig(**_gravac_options(cfg), **engine)
        self._gravac = GravacOptimizer(
            _optimizer(model, cfg), config, overlap=cfg.overlap, bucket_bytes=bucket_bytes
        )
        self.optimizer = self._gravac

    def after_step(self) -> StepFigures:
        return _figures(self._gravac.last_record)

    def options(self) -> dict[str, Any]:
        return {
            "overlap": self._overlap,
            "memory": _memory(self._gravac.engine),
            "bucket_bytes": self._gravac.bucket_bytes,
            **_topology(self._gravac.engine),
        }

    def close(self) -> None:
        self._gravac.close()


class GravacMode(Mode):
    name = "gravac"
    summary = "GravacOptimizer around SGD on the plain model"
    comm_source = "record"
    takes_variants = True

    def check(self, cfg: CompareConfig) -> None:
        _check_gravac_options(cfg)

    def open(self, model: nn.Module, cfg: CompareConfig) -> Session:
        return _GravacSession(model, cfg)


class _GravacDdpSession(Session):
    def __init__(self, model: nn.Module, cfg: CompareConfig) -> None:
        bucket_bytes, options = _split_bucket_bytes(cfg.engine_options)
        ddp = {} if bucket_bytes is None else {"bucket_cap_mb": bucket_bytes / _MIB}
        self.module = _ddp(model, cfg, **ddp)
        self._bucket_bytes = bucket_bytes
        self.state = GravacHookState(None, GravacConfig(**_gravac_options(cfg), **options))
        self.module.register_comm_hook(self.state, gravac_hook)
        self.optimizer = _optimizer(model, cfg)
        self.state.watch(self.optimizer)  # learning-rate decays reach the accordion policy

    def after_step(self) -> StepFigures:
        return _figures(self.state.engine.last_record)

    def options(self) -> dict[str, Any]:
        return {
            "memory": _memory(self.state.engine),
            "bucket_bytes": self._bucket_bytes,
            **_topology(self.state.engine),
        }


class GravacDdpMode(Mode):
    name = "gravac-ddp"
    runs_ddp = True
    summary = "DDP + gravac's comm hook (gravac.ddp)"
    comm_source = "record"
    takes_variants = True

    def check(self, cfg: CompareConfig) -> None:
        _check_gravac_options(cfg)

    def open(self, model: nn.Module, cfg: CompareConfig) -> Session:
        return _GravacDdpSession(model, cfg)


#: every mode, by name, in the order ``--help`` lists them
MODES: dict[str, Mode] = {
    m.name: m for m in (DdpMode(), DdpFp16Mode(), DdpPowerSgdMode(), GravacMode(), GravacDdpMode())
}


def names() -> list[str]:
    """The registered mode names."""
    return list(MODES)


def get(name: str) -> Mode:
    """The mode called ``name``.

    Raises:
        ValueError: no such mode; the message names ``--modes`` and lists the modes.
    """
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"--modes: unknown mode {name!r}; choose from {names()}") from None


def check_config(cfg: CompareConfig) -> CompareConfig:
    """``cfg``, checked against each of its modes (:meth:`Mode.check`: the options a mode
    needs, gravac's compressor, policy and engine options) before any worker starts.

    Raises:
        ValueError: an unknown mode, or one that cannot run ``cfg``; the message names the
            option.
    """
    for name in cfg.modes:
        get(name).check(cfg)
    return cfg
