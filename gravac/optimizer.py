"""GravacOptimizer: adaptive gradient compression around any ``torch.optim`` optimizer.

A thin front end over the step engine (:mod:`gravac.engine`, docs/design.md section 4), which the
DDP comm hook (:mod:`gravac.ddp`) shares. Gradients are packed into buckets in reverse
parameter order, as DDP fills them; with ``overlap=True`` (default) a post-accumulate-grad hook
launches each bucket (error feedback, compression at the planned CFs, the collective) as soon
as its gradients are ready during ``backward()``, in bucket order on every rank, and
:meth:`GravacOptimizer.step` only launches what is left, waits, and steps the wrapped
optimizer. The CF sent at step t is decided from values agreed through step t - 1, so no
bucket waits for a decision; the step's own scalars travel in one small asynchronous
collective beside the payloads.

The gain is taken over the compressed buckets (summed over buckets and ranks): the dense 1-D
tensors travel exactly whatever the CF and would only pull it towards 1.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gravac.agreement import check_agreement, layout_text
from gravac.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DENSE_BYTES,
    Bucket,
    Layout,
    Run,
    Signature,
    build_layout,
    check_bytes,
    check_params,
    check_resized,
    default_bucket_bytes,
    gather_grads,
    join_flat,
    layout_signature,
    scatter_grads,
    split_flat,
)
from gravac.comm import Communicator
from gravac.compressors.base import Compressor
from gravac.config import GravacConfig, build_engine, learning_rate
from gravac.control.protocol import Controller
from gravac.engine import Engine, Given, Outcome, SparseGradientError, Step, Unit, layout_check
from gravac.kernels.buffers import is_sole
from gravac.memory import Memory
from gravac.monitor import Monitor, StepRecord

__all__ = ["GravacOptimizer", "broadcast_parameters"]

#: The step is skipped on every rank (nothing to apply).
_SKIPPED: Any = object()

#: Why a step that a ``torch.amp.GradScaler`` drives must be synchronised first.
_UNSYNCHRONIZED_SCALER = (
    "torch.amp.GradScaler.step(opt) reached GravacOptimizer.step() before the gradients were "
    "aggregated: torch's scaler checks (and unscale_() rescales) each rank's own gradients, "
    "whose buckets gravac has already sent, so the ranks' loss scales would drift apart and "
    "the update would use scaled gradients. Use gravac.amp.GradScaler, a drop-in "
    "torch.amp.GradScaler that aggregates first, or call opt.synchronize() after backward() "
    "and before scaler.unscale_(opt) and scaler.step(opt)"
)


#: the live GravacOptimizer that trains each parameter, by the parameter's id (an optimizer
#: holds its parameters, so an id is not reused while its owner lives)
_OWNERS: weakref.WeakValueDictionary[int, GravacOptimizer] = weakref.WeakValueDictionary()


@dataclass
class _Proposal:
    """A layout this rank changed to since its last step, not yet trained on: the step it was
    seen at still runs on the old layout, its scalars carrying the new one's digest; once every
    rank's matched (``agreed``), the next step adopts it."""

    signature: Signature
    digest: int
    agreed: bool = False


def broadcast_parameters(
    module: torch.nn.Module, *, src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Copy ``module``'s parameters and buffers from global rank ``src`` to every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    with torch.no_grad():
        Communicator(group).broadcast_([*module.parameters(), *module.buffers()], src)


def _units(layout: Layout) -> list[Unit]:
    """The layout's buckets as engine units, in launch order (compressed ones first); slots
    index :attr:`Layout.params`, and are the layers' stable ids too."""
    units, slot = [], 0
    n_compressed = len(layout.compressed)
    for i, b in enumerate(layout.buckets):
        slots = tuple(range(slot, slot + len(b.params)))
        slot += len(b.params)
        units.append(Unit(b.key, b.shapes, i < n_compressed, slots=slots, layers=slots))
    return units


def _moved_layers(old: Layout, new: Layout) -> dict[int, int]:
    """Each compressed tensor's (or piece's) layer id in ``old`` -> its id in ``new``
    (:func:`_units`), for those compressed in both: a parameter added, frozen or unfrozen moves
    the ids of the others."""

    def ids(layout: Layout) -> dict[tuple[int, tuple[int, int] | None], int]:
        out, slot = {}, 0
        for i, b in enumerate(layout.buckets):
            for p in b.params:
                if i < len(layout.compressed):
                    out[(id(p), b.rows)] = slot
                slot += 1
        return out

    now = ids(new)
    return {slot: now[key] for key, slot in ids(old).items() if key in now}


class GravacOptimizer(torch.optim.Optimizer, Joinable):
    """Wraps ``optimizer`` and compresses its gradients across ranks with an adaptive CF.

    Each bucket's gradients are views of one flat buffer (the last aggregate). The buffer of a
    tensor bucketed or split alone is held only through its gradient:
    ``zero_grad(set_to_none=True)`` frees it before backward makes the fresh gradient, which
    (if its memory no other tensor shares) becomes the buffer as it is, uncopied: a reference
    to it kept across :meth:`step` then sees the engine's work in it (the residual), as a kept
    view of a buffer does. A bucket of several tensors keeps its buffer, and their fresh
    gradients are copied into it.

    Args:
        optimizer: the optimizer to wrap; its ``param_groups`` are shared (LR schedulers work).
        config: the compression, search and engine options (:class:`gravac.GravacConfig`:
            ``compressor``, ``policy``, ``search``, ``theta_min`` ... ``clock``); ``None``:
            the defaults.
        **options: :class:`gravac.GravacConfig`'s fields as keywords, replacing the config's
            (``GravacOptimizer(sgd, compressor="topk", search="shadow")``).
        process_group: the group to communicate in (``None``: the default group, or a single
            worker when ``torch.distributed`` is not initialised).
        bucket_bytes: largest compressed bucket; ``None`` (default): DDP's 25 MiB, or the
            compressor's smaller size (:attr:`gravac.compressors.Compressor.bucket_bytes`:
            2 MiB for the 16-bit casts, whose pieces pipeline the cast with the wire) raised
            to a sixteenth of the compressed gradient's bytes
            (:func:`gravac.buckets.default_bucket_bytes`). The first bucket, of the last
            layers, is at most 1 MiB, as DDP's. A tensor larger than this is split by rows
            across buckets of its own, each compressed and sent on its own
            (:mod:`gravac.buckets`).
        dense_bytes: tensors smaller than this, and every 1-D tensor, travel dense (default 0:
            every tensor of 2 or more dimensions is packed into a bucket and compressed).
        sync_buffers: a module whose buffers (BatchNorm's running statistics, ...) are
            broadcast from rank 0 after every step, as ``DistributedDataParallel`` does before
            every forward (``broadcast_buffers=True``); ``None`` leaves buffers per rank.
        overlap: launch each bucket during ``backward()`` as soon as its gradients are ready
            (default); ``False`` launches every bucket in :meth:`step`. The results are
            bit-identical either way. With overlap, accumulate gradients over several
            backward passes inside :meth:`no_sync` (as with DDP), and read gradients after
            :meth:`synchronize` only: a launched bucket's buffer holds the engine's work
            (:meth:`gravac.engine.Engine.launch` with ``Given``) until the aggregate is written.
    """

    #: torch.amp.GradScaler.step hands this optimizer the loss scale and its Inf/NaN flag
    #: (``grad_scale``, ``found_inf``) and leaves unscaling and skipping to :meth:`step`,
    #: instead of unscaling gradients that backward() has already sent
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: GravacConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int | None = None,
        dense_bytes: int = DEFAULT_DENSE_BYTES,
        sync_buffers: torch.nn.Module | None = None,
        overlap: bool = True,
        **options: Any,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        if isinstance(optimizer, GravacOptimizer):
            raise ValueError("optimizer is already a GravacOptimizer; wrap the inner one once")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer must not be LBFGS: it re-evaluates its closure several times inside "
                "one step(), and gravac aggregates the gradients across ranks once per step"
            )
        if sync_buffers is not None and not isinstance(sync_buffers, torch.nn.Module):
            raise ValueError(
                f"sync_buffers must be a torch.nn.Module or None, got {sync_buffers!r}"
            )
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        check_bytes("bucket_bytes", bucket_bytes, optional=True, least=1)
        check_bytes("dense_bytes", dense_bytes)
        self.engine: Engine = build_engine(process_group, config, **options)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        check_params(params)
        super().__init__([{"params": params}], {})
        Joinable.__init__(self)  # torch's Join: uneven inputs (join_hook)
        self._shadowing = False  # a joined rank runs a step of the others' (_JoinHook)
        # From here on param_groups, state and defaults are the wrapped optimizer's own objects.
        self.optimizer = optimizer
        self.bucket_bytes = (
            bucket_bytes
            if bucket_bytes is not None
            else default_bucket_bytes(self.engine.compressor.bucket_bytes, params)
        )
        self.dense_bytes = dense_bytes
        self.sync_buffers = sync_buffers
        self.overlap = overlap
        self._layout: Layout | None = None
        self._layout_digest = 0  # of the layout's parameters (layout_check), sent every step
        self._proposal: _Proposal | None = None  # a layout changed to, not yet adopted
        self._checked = False  # whether the ranks agreed on everything since the last load
        self._units: list[Unit] = []  # the layout's units, in launch order
        self._runs: tuple[Run, ...] = ()  # the units grouped by the buffer they share
        # per run, the flat buffer its gradients are views of: the last aggregate's, which
        # alternates with the residuals' storage (Engine.launch with Given); None: not made yet.
        # How it is held (_hold): a tensor's own run weakly, through its gradient, which
        # zero_grad(set_to_none=True) frees, so that backward's fresh gradient is not
        # allocated beside it (one gradient more at the peak) but taken as the next buffer;
        # a run of several tensors strongly, their fresh gradients copied into it and freed
        # bucket by bucket (a new buffer at every step would fault its pages in anew)
        self._flats: list[Callable[[], Tensor | None] | None] = []
        self._run_of: list[int] = []  # per unit, the index of its run
        self._unit_of: dict[int, list[int]] = {}  # parameter id -> indices of its units
        self._ready: list[set[int]] = []  # per unit: ids of parameters whose gradient is ready
        self._step: Step | None = None  # the step whose units are being launched
        self._next = 0  # the next unit to launch
        # each launched gradient's identity and version: a change after launch is an error
        self._stamps: list[tuple[Tensor, tuple[int, int] | None]] = []
        self._sparse = -1  # the first parameter with a sparse gradient this step (-1: none)
        self._accumulating = False  # inside no_sync(): no launches
        self._pending: Outcome | None = None  # aggregated by synchronize(), not yet stepped
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()  # ids of the parameters hooked
        self._warned_graph = False  # backward(create_graph=True) said once (_warn_graph)
        if overlap:
            self._hook(params)

    # ------------------------------------------------------------------ engine state
    # The engine's state, under the names users and checkpoints know.
    @property
    def compressor(self) -> Compressor:
        return self.engine.compressor

    @property
    def controller(self) -> Controller:
        return self.engine.controller

    @property
    def memory(self) -> Memory:
        return self.engine.memory

    @property
    def comm(self) -> Communicator:
        return self.engine.comm

    @property
    def monitor(self) -> Monitor | None:
        return self.engine.monitor

    @property
    def clock(self) -> Callable[[], float]:
        return self.engine.clock

    @property
    def steps(self) -> int:
        """Steps taken (skipped ones not counted)."""
        return self.engine.steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank (non-finite values), or synchronised and dropped."""
        return self.engine.skipped_steps

    @property
    def synchronized(self) -> bool:
        """Whether this step is aggregated already (:meth:`synchronize` ran, no step since)."""
        return self._pending is not None

    def rescale(self, factor: float) -> None:
        """Multiply everything kept in the gradients' unit by ``factor``, between steps:
        the residuals (error feedback), DGC's momenta and the search's sums
        (:meth:`gravac.engine.Engine.rescale`). For a loss scale that changed by ``factor``
        from this step's backward to the next's, so that error feedback adds each residual
        to gradients of its own unit; :class:`gravac.amp.GradScaler` calls it.

        Raises:
            RuntimeError: a step is launched or synchronised and not yet stepped.
            ValueError: ``factor`` is not a finite number above 0.
        """
        if self._step is not None or self._pending is not None:
            raise RuntimeError(
                "rescale() between steps only: a backward pass launched a step, or "
                "synchronize() aggregated one, that no step() has used yet"
            )
        self.engine.rescale(factor)

    @property
    def total_wire_bytes(self) -> int:
        """Bytes this rank sent over all steps taken."""
        return self.engine.total_wire_bytes

    @property
    def total_dense_wire_bytes(self) -> int:
        """Bytes float32 all-reduces would have sent over the same steps."""
        return self.engine.total_dense_wire_bytes

    @property
    def last_record(self) -> StepRecord | None:
        """What the last step taken did."""
        return self.engine.last_record

    # ------------------------------------------------------------------ torch.optim API
    # param_groups, state and defaults are always the wrapped optimizer's own objects, also
    # after its load_state_dict() replaced them: LR schedulers, opt.state[p] and frameworks
    # that rebuild the groups see one set. Before the wrapped optimizer is attached (inside
    # Optimizer.__init__) they are this object's placeholders.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner_or_own("param_groups")

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._set_inner_or_own("param_groups", value)

    @property
    def state(self) -> Any:
        return self._inner_or_own("state")

    @state.setter
    def state(self, value: Any) -> None:
        self._set_inner_or_own("state", value)

    @property
    def defaults(self) -> dict[str, Any]:
        return self._inner_or_own("defaults")

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._set_inner_or_own("defaults", value)

    def _inner_or_own(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        return getattr(inner, name) if inner is not None else self.__dict__[f"_own_{name}"]

    def _set_inner_or_own(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__[f"_own_{name}"] = value

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "a GravacOptimizer cannot be copied or pickled: it holds a process group, a monitor "
            "and a clock; save opt.state_dict() and load it into a new GravacOptimizer instead"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (the groups are shared). A group that a layout
        cannot hold (:func:`gravac.buckets.check_params`) is refused, and not added."""
        if not hasattr(self, "optimizer"):  # called by Optimizer.__init__ for the placeholder
            super().add_param_group(param_group)
            return
        self.optimizer.add_param_group(param_group)
        try:
            check_params(self._params())
        except ValueError:
            self.optimizer.param_groups.pop()
            raise
        if self.overlap:
            self._hook(self.param_groups[-1]["params"])

    def state_dict(self) -> dict[str, Any]:
        """Wrapped optimizer state, residuals, controller, compressor state and counters."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "gravac": {
                **self.engine.state_dict(),
                # What the residuals are only valid with (checked by load_state_dict).
                # the layout the residuals belong to: a change no step adopted yet (a
                # tensor frozen, a group added) is not theirs
                "layout": self._layout_shapes(self._layout),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: same compressor (name and options) and
        bucket layout; a different world size loads with a warning (residuals are per rank).

        Everything is checked before anything changes, and a load that fails part-way is
        rolled back: a failed load leaves this optimizer as it was.

        Raises:
            ValueError: not a GravacOptimizer state dict, another compressor or layout, or a
                controller state outside this optimizer's CF range.
            RuntimeError: a backward pass launched a step that was not stepped yet (its
                commit would overwrite the loaded residuals).
        """
        if self._step is not None:
            raise RuntimeError(
                f"load_state_dict() while step {self.engine.steps} is in flight: a backward "
                "pass sent its gradients with the residuals held now, and its commit would "
                "overwrite the loaded ones; load before backward(), or after opt.step() or "
                "opt.zero_grad()"
            )
        if set(state_dict) != {"optimizer", "gravac"}:
            raise ValueError(
                f"not a GravacOptimizer state dict: keys {sorted(state_dict)}, "
                "expected ['gravac', 'optimizer']"
            )
        g = state_dict["gravac"]
        self._bind(self._fresh_layout())  # the saved CFs are those these shapes deliver
        self._check_checkpoint(g)
        before = copy.deepcopy(self.state_dict())
        try:
            self._load(state_dict)
        except Exception:
            self._load(before)
            raise
        self._checked = False  # the next step checks that every rank loaded the same step

    def _check_checkpoint(self, g: dict[str, Any]) -> None:
        layout = g.get("layout")
        if layout is not None and layout != self._layout_shapes():
            raise ValueError(
                f"the checkpoint's bucket layout {layout} differs from this optimizer's "
                f"{self._layout_shapes()} (other parameters, bucket_bytes or dense_bytes; a "
                "checkpoint from before tensors larger than bucket_bytes were split across "
                "buckets; or one of fp16 or bf16 from before their buckets became 2 MiB: "
                f"bucket_bytes={DEFAULT_BUCKET_BYTES} loads it; or one saved after a tensor was "
                "frozen or a group added and before a step adopted that layout: load it into "
                "the parameters as they were, and change them after): its residuals do not apply"
            )
        layout = self._fresh_layout()
        sent = [self.engine.chunk_unit(u) for u in _units(layout)]
        compressed = zip(sent[: len(layout.compressed)], layout.compressed, strict=True)
        units = {u.key: (u.numel, b.dtype) for u, b in compressed}
        self.engine.check_state(g, units=units)

    def _load(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.engine.load_state_dict(state_dict["gravac"])

    def _fresh_layout(self) -> Layout:
        """The bucket layout of the parameters as they are now."""
        params = [p for grp in self.param_groups for p in grp["params"]]
        return build_layout(params, bucket_bytes=self.bucket_bytes, dense_bytes=self.dense_bytes)

    def _layout_shapes(self, layout: Layout | None = None) -> list[list[list[int]]]:
        """The compressed buckets' tensor shapes of ``layout`` (``None``: the parameters' as
        they are now), as saved in a checkpoint."""
        layout = self._fresh_layout() if layout is None else layout
        return [[list(shape) for shape in b.shapes] for b in layout.compressed]

    def _bind(self, layout: Layout) -> None:
        """Let the engine plan its CFs over the shapes of ``layout``'s compressed tensors (of
        their chunks, in two levels)."""
        units = [self.engine.chunk_unit(u) for u in _units(layout)]
        self.engine.bind_shapes([shape for u in units if u.compressed for shape in u.shapes])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Aggregate compressed gradients across ranks, then step the wrapped optimizer.

        After :meth:`synchronize` the aggregate is already in ``p.grad``: only the wrapped
        optimizer steps (no second aggregation).
        """
        loss = None
        found_inf = getattr(self, "found_inf", None)  # set by torch.amp.GradScaler.step
        if found_inf is not None and self._pending is None:
            raise RuntimeError(_UNSYNCHRONIZED_SCALER)
        if closure is not None and self._pending is None:
            with torch.enable_grad():
                loss = closure()
        if self._pending is None:
            self._pending = self._synchronize(explicit=False)
        pending, self._pending = self._pending, None
        if pending is not _SKIPPED and found_inf is not None:
            pending = self._unscaled(pending, found_inf, getattr(self, "grad_scale", None))
        if pending is not _SKIPPED:
            self.optimizer.step()
            self.engine.finish(pending)
        if self.sync_buffers is not None:
            self.comm.broadcast_(list(self.sync_buffers.buffers()))
        return loss

    def _unscaled(self, pending: Outcome, found_inf: Tensor, grad_scale: Tensor | None) -> Any:
        """A synchronised step under a ``torch.amp.GradScaler``
        (:attr:`_step_supports_amp_scaling`): :data:`_SKIPPED` where the scaler found Inf or
        NaN in the aggregates (the same on every rank: they are identical), else ``pending``
        with the aggregates unscaled where the scaler left them scaled (``grad_scale``, the
        scale; ``None`` after ``scaler.unscale_(opt)``), by the reciprocal ``unscale_``
        multiplies by."""
        if bool(found_inf):
            self.engine.skipped_steps += 1
            return _SKIPPED
        if grad_scale is not None:
            inverse = grad_scale.double().reciprocal().float()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inverse.to(p.grad.device))
        return pending

    @torch.no_grad()
    def synchronize(self) -> None:
        """Aggregate the gradients now and write the result into ``p.grad``; the next
        :meth:`step` only steps the wrapped optimizer.

        For work between aggregation and the update, on the aggregated gradients (identical on
        every rank): gradient clipping, ``GradScaler.unscale_`` (mixed precision; or use
        :class:`gravac.amp.GradScaler`, which calls this itself and keeps the residuals in the
        loss scale's unit). The pattern, as Horovod's::

            scaler.scale(loss).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)      # steps unless it found Inf/NaN
            scaler.update()

        A step skipped for a non-finite gradient (on any rank) or aggregate fills every
        gradient with NaN on every rank, so that ``GradScaler`` skips it everywhere and its
        scales stay equal. A synchronised step that was never stepped is dropped (counted in
        :attr:`skipped_steps`) by the next call.

        Raises:
            FloatingPointError: ``nonfinite="raise"`` and a gradient or aggregate is not finite.
        """
        self._drop_pending()
        self._pending = self._synchronize(explicit=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (free them with ``set_to_none``), as
        ``torch.optim.Optimizer.zero_grad`` does; first drop what was aggregated or launched
        for them and never stepped.

        A backward pass launches its gradients' buckets as they become ready. Where one is
        followed by ``zero_grad()`` instead of :meth:`step` (a GAN's generator loss
        backpropagated through the discriminator this optimizer trains, gradients computed
        for a look only), the launched step is dropped on every rank: its collectives
        complete, and the residuals, compressor and search are as if it had not been. Every
        rank must then call ``zero_grad()`` alike: where one steps instead, both raise. A
        step aggregated by :meth:`synchronize` and never stepped is dropped too (counted in
        :attr:`skipped_steps`).
        """
        if self._step is not None:
            with torch.no_grad():
                self._synchronize(explicit=False, dropped=True)
        self._drop_pending()
        super().zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several backward passes without launching buckets (as
        ``DistributedDataParallel.no_sync``); the backward after the block launches them::

            with opt.no_sync():
                for micro in batches[:-1]:
                    loss_fn(model(micro)).backward()
            loss_fn(model(batches[-1])).backward()
            opt.step()
        """
        before, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = before

    def _drop_pending(self) -> None:
        """Drop a step aggregated by :meth:`synchronize` and never stepped (counted in
        :attr:`skipped_steps`), so that the next step aggregates its own gradients."""
        if self._pending is not None and self._pending is not _SKIPPED:
            self.engine.skipped_steps += 1
        self._pending = None

    def _synchronize(self, *, explicit: bool, dropped: bool = False) -> Any:
        """Everything of a step but the wrapped optimizer's: launch what backward did not,
        wait, commit, write ``p.grad``; :data:`_SKIPPED` when the step is skipped on every
        rank, or ``dropped`` (:meth:`zero_grad`) on every rank."""
        step = self._step if self._step is not None else self._begin()
        try:
            layout = self._layout
            assert layout is not None  # set by _begin
            while self._next < len(self._units):
                self._launch_next(step)
            has_grad = [p.grad is not None for p in layout.params]
            stale = any(_stamp(p) != stamp for p, stamp in self._stamps)
            digest = self._layout_digest if self._proposal is None else self._proposal.digest
            self.engine.close(
                step, has_grad, stale, layout=digest, sparse=self._sparse, dropped=dropped
            ).wait()
            outcome = self.engine.commit(step)
        except SparseGradientError as exc:
            raise self._sparse_error(exc.index, f"rank(s) {exc.ranks}") from None
        finally:
            self._step = None
        if self._proposal is not None:  # every rank changed its layout alike
            self._proposal.agreed = True
            if not outcome.skipped:
                self._aggregate_uncovered(layout)
        if outcome.skipped:
            if explicit:  # GradScaler after synchronize() must skip it on every rank too
                for p in layout.params:
                    if p.grad is None:
                        p.grad = torch.full_like(p, math.nan)
                    else:
                        p.grad.fill_(math.nan)
            return _SKIPPED
        for i, run in enumerate(self._runs):
            # the engine's buffers for these aggregates (launch with Given): a split tensor's
            # pieces lie end to end in one but after a first step or a resume (copied once)
            parts = outcome.grads[run.first : run.stop]
            flat = parts[0] if len(parts) == 1 else join_flat(parts)
            if flat is None:
                flat = torch.cat(parts)
            self._flats[i] = _hold(flat, run.bucket)
            scatter_grads(run.bucket, flat)
        # A parameter without a gradient on every rank keeps grad None (torch.optim leaves it
        # alone); one that has a gradient on some rank counts as zeros on the others (as DDP).
        # In two levels a chunk's residual is sent whole, a tensor without a gradient included:
        # where some of it was sent, the tensor takes it (nothing of a residual is lost).
        chunked = self.engine.hierarchy is not None
        for p, present in zip(layout.params, outcome.present, strict=True):
            if not present and not (chunked and p.grad is not None and bool(p.grad.any())):
                p.grad = None
        return outcome

    # ------------------------------------------------------------------ overlap
    def _hook(self, params: list[Tensor]) -> None:
        """Register :meth:`_grad_ready` on ``params``, through a weak reference: the hooks do
        not keep this optimizer alive, and go with it (:meth:`__del__`)."""
        ref = weakref.ref(self)

        def ready(p: Tensor) -> None:
            opt = ref()
            if opt is None:
                return
            if not torch.is_grad_enabled():
                opt._grad_ready(p)
                return
            opt._warn_graph()  # backward(create_graph=True) runs the hooks with grad mode on
            with torch.no_grad():
                opt._grad_ready(p)

        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._hooks.append(p.register_post_accumulate_grad_hook(ready))
                self._hooked.add(id(p))

    def _warn_graph(self) -> None:
        """Say once that gradients of ``backward(create_graph=True)`` are aggregated as data:
        as under DDP, the aggregate in ``p.grad`` carries no graph (in-place work on a
        gradient that had one raised from inside backward)."""
        if not self._warned_graph:
            self._warned_graph = True
            warnings.warn(
                "gravac aggregates the gradients of backward(create_graph=True) as data, as "
                "DistributedDataParallel does: p.grad holds the aggregate, without a graph; "
                "take higher-order terms with torch.autograd.grad",
                UserWarning,
                stacklevel=3,
            )

    def _unhook(self) -> None:
        hooks = getattr(self, "_hooks", [])  # none yet where __init__ raised
        for h in hooks:
            h.remove()
        hooks.clear()
        getattr(self, "_hooked", set()).clear()
        self._release()

    def __del__(self) -> None:
        self._unhook()

    def _grad_ready(self, p: Tensor) -> None:
        """A gradient is accumulated: launch every bucket, in order, whose gradients are all
        ready (a bucket waits for those before it, so every rank launches in one order)."""
        if self._accumulating:
            return
        self._drop_pending()  # a backward after synchronize() without a step: a new step
        step = self._step if self._step is not None else self._begin()
        indices = self._unit_of.get(id(p))
        if indices is None:  # not compressed or sent by this optimizer (frozen)
            return
        if indices[0] < self._next:  # accumulated after its bucket was sent: the step's
            return  # close sees the gradient changed and raises on every rank (_synchronize)
        for index in indices:
            self._ready[index].add(id(p))
        while self._next < len(self._units) and len(self._ready[self._next]) == len(
            self._units[self._next].slots
        ):
            self._launch_next(step)

    def _launch_next(self, step: Step) -> None:
        """Launch the run that starts at the next unit: its gradients are packed into its
        buffer, then each of its units (the pieces of a split tensor) goes on its own."""
        index = self._run_of[self._next]
        run = self._runs[index]
        bucket = run.bucket
        self._note_sparse(bucket.params)
        buf = self._buffer(index)
        complete = all(p.grad is not None and not p.grad.is_sparse for p in bucket.params)
        units = self._units[run.first : run.stop]
        parts = buf.split(run.sizes) if len(units) > 1 else (buf,)
        if self.engine.hierarchy is not None:
            self._launch_chunks(step, run, buf, parts)
            return
        # the buffer is the engine's until commit: x = g + e is formed in it (as the gradients
        # are written into it, where the engine allows), and it becomes the residual while the
        # aggregate lands in the old residual's storage, which becomes the gradients' buffer
        # (no gradient-sized temporary, no buffer of x's own)
        addends = [
            self.engine.addend(step, u, part, complete=complete)
            for u, part in zip(units, parts, strict=True)
        ]
        e = None
        if all(a is not None for a in addends):
            e = join_flat([a for a in addends if a is not None])
        gather_grads(bucket, buf, plus=e)
        # a split tensor's first aggregates, with no residuals to land in, share one buffer
        spares: Sequence[Tensor | None] = [None] * len(units)
        if len(units) > 1 and all(self.engine.needs_spare(step, u) for u in units):
            spares = torch.empty_like(buf).split(run.sizes)
        for u, part, spare in zip(units, parts, spares, strict=True):
            given = Given(packed=e is not None, spare=spare)
            self.engine.launch(step, u, part, given, complete=complete)
        self._stamps += [(p, _stamp(p)) for p in bucket.params]
        self._next += len(units)

    def _launch_chunks(self, step: Step, run: Run, buf: Tensor, parts: Sequence[Tensor]) -> None:
        """Launch ``run`` in two levels: its gradients packed into ``buf``, each unit's node
        sum reduce-scattered and its chunk launched by the engine (:meth:`Engine.scatter`)."""
        gather_grads(run.bucket, buf)
        for unit, part in zip(self._units[run.first : run.stop], parts, strict=True):
            self.engine.scatter(step, unit, part)
        self._stamps += [(p, _stamp(p)) for p in run.bucket.params]
        self._next += len(parts)

    def _buffer(self, index: int) -> Tensor:
        """The flat buffer run ``index``'s gradients are packed into: the last aggregate's,
        while held (:func:`_hold`); else a fresh gradient that fills the run's bucket alone,
        taken as it is (:func:`_sole_gradient`: no copy beside it); else a new one, made as
        first needed: the gradients it replaces are freed bucket by bucket, so the switch
        never holds a second copy of them all."""
        bucket = self._runs[index].bucket
        ref = self._flats[index]
        held = None if ref is None else ref()
        if held is not None and held.is_contiguous() and held.numel() == bucket.numel:
            return held.view(-1)
        buf = _sole_gradient(bucket)
        if buf is None:
            buf = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device)
        self._flats[index] = _hold(buf, bucket)
        return buf

    def _begin(self) -> Step:
        """Start a step: join the group, tell a ``Join`` context this rank still trains, check
        the layout, plan and decide."""
        self.engine.join_group()
        if not self._shadowing:
            Join.notify_join_context(self)
        self._sparse = -1
        self._current_layout()
        self._step = self.engine.begin(lr=learning_rate(self.optimizer))
        self._next = 0
        self._ready = [set() for _ in self._units]
        self._stamps = []
        return self._step

    # ------------------------------------------------------------------ internals
    def _current_layout(self) -> Layout:
        """The layout this step trains on.

        At the first step, and the first after a load, every rank checks its configuration,
        layout and step against rank 0's in a collective of its own (:meth:`_check_agreement`).
        After that a layout can change on some ranks only (a group added, a tensor frozen), so
        a change is not adopted at once, which would send payloads of another layout than the
        other ranks': the step that sees it still trains on the old layout and sends the new
        one's digest with its scalars (:meth:`Engine.close`), where every rank compares it; the
        next step adopts it if every rank changed alike, and raises on every rank if not.
        """
        params = self._params()
        sig = layout_signature(params)
        if self._layout is not None and self._layout.signature != sig:
            check_resized(self._layout.signature, params)
        if self._layout is None or not self._checked:
            self._check_agreement(params)
            self.engine.form_nodes()
            self._checked = True
        elif self._layout.signature != sig:
            proposal = self._proposal
            if proposal is None or proposal.signature != sig:
                self._proposal = _Proposal(sig, layout_check(layout_text(params)))
                return self._layout
            if not proposal.agreed:
                return self._layout
        if self._layout is not None and self._layout.signature == sig:
            self._proposal = None
            return self._layout
        return self._adopt(params)

    def _adopt(self, params: list[Tensor]) -> Layout:
        """Train on the layout of ``params`` from this step on: the old layout's residuals go
        into the gradients, the per-layer state moves with its tensors, new trainable
        tensors are hooked."""
        self._claim(params)
        new = self._fresh_layout()
        if self._layout is not None:
            self._flush_residuals(self._layout)
            self.engine.relayer(_moved_layers(self._layout, new))
        self._layout = new
        self._layout_digest = layout_check(layout_text(params))
        self._proposal = None
        if self.overlap:
            self._hook(params)
        self._bind(new)
        self._units = _units(new)
        self._runs = new.runs
        self._flats = [None] * len(self._runs)
        self._run_of = [i for i, run in enumerate(self._runs) for _ in run.sizes]
        self._unit_of = {}
        for i, u in enumerate(self._units):
            for p in _params(new, u):
                self._unit_of.setdefault(id(p), []).append(i)
        return new

    def _claim(self, params: list[Tensor]) -> None:
        """Own the trainable ``params``: refuse one that another live GravacOptimizer trains
        (both would aggregate its gradient, each with its own residual; the second found the
        gradient overwritten by the first's aggregate). Checked where a layout is adopted, not
        at construction: ``opt = GravacOptimizer(...)`` over the same model again builds the
        new one while the old one still lives."""
        taken = self._taken(params)
        if taken:
            i = taken[0]
            raise ValueError(
                f"parameter {i} (shape {tuple(params[i].shape)}) is trained by another "
                "GravacOptimizer that is still alive: each gradient is aggregated by one "
                "optimizer, whose residual it keeps; give the optimizers disjoint "
                "parameters, or close() the other one first"
            )
        trained = {id(p) for p in params if p.requires_grad}
        self._release(keep=trained)
        for key in trained:
            _OWNERS[key] = self

    def _taken(self, params: list[Tensor]) -> list[int]:
        """The indices of the trainable ``params`` that another live GravacOptimizer trains."""
        return [
            i
            for i, p in enumerate(params)
            if p.requires_grad and _OWNERS.get(id(p), self) is not self
        ]

    def _release(self, keep: Collection[int] = ()) -> None:
        """Give up this optimizer's parameters but ``keep`` (ids)."""
        for key, owner in list(_OWNERS.items()):
            if owner is self and key not in keep:
                del _OWNERS[key]

    def _check_agreement(self, params: list[Tensor]) -> None:
        """Every rank must run this configuration on this parameter layout, at this step
        (raises if not)."""
        settings = (
            f"error_feedback={type(self.memory).__name__}, bucket_bytes={self.bucket_bytes}, "
            f"dense_bytes={self.dense_bytes}"
        )
        parts = {
            **self.engine.agreement_parts(),
            "the bucketing and error-feedback settings": settings,
            "the parameters (order, shapes, dtypes, requires_grad)": layout_text(params),
        }
        check_agreement(self.comm, parts, self.comm.device)

    def _aggregate_uncovered(self, layout: Layout) -> None:
        """Average, densely, the gradients of the trainable parameters that ``layout`` (the
        one the step trained on) left out: tensors added or unfrozen at this step, which every
        rank changed alike. A tensor without a gradient on any rank keeps ``None``; one that
        has it on some ranks counts as zeros on the others (as in a compressed step). A mean
        that is not finite is left out of the step on every rank (``grad = None``), with a
        warning: the rest of the step is committed already."""
        covered = {id(p) for p in layout.params}
        extra = [p for p in self._params() if p.requires_grad and id(p) not in covered]
        if not extra or self.comm.world_size == 1:
            return
        sparse = [p.grad is not None and p.grad.is_sparse for p in extra]
        flags = [p.grad is not None and not s for p, s in zip(extra, sparse, strict=True)]
        counts = torch.tensor([*flags, *sparse], dtype=torch.float64, device=self.comm.device)
        grads = [
            torch.zeros_like(p) if p.grad is None or s else p.grad
            for p, s in zip(extra, sparse, strict=True)
        ]
        self.comm.all_reduce_([counts, *grads])
        summed = counts.tolist()
        present, sparse_counts = summed[: len(extra)], summed[len(extra) :]
        for p, n in zip(extra, sparse_counts, strict=True):
            if n > 0:
                raise self._sparse_error(self._index(p), f"{int(n)} rank(s)")
        for p, g, n in zip(extra, grads, present, strict=True):
            if n == 0:
                p.grad = None
            elif not bool(torch.isfinite(g).all()):
                warnings.warn(
                    f"gravac left a parameter of shape {tuple(p.shape)} out of step "
                    f"{self.engine.steps}: its first averaged gradient (dense, as it joined "
                    "the layout) was not finite",
                    RuntimeWarning,
                    stacklevel=3,
                )
                p.grad = None
            else:
                p.grad = g.div_(self.comm.world_size)

    def _flush_residuals(self, old: Layout) -> None:
        """Move the residuals of an outdated layout into the gradients, so none is lost.

        A parameter frozen since is left alone, residual included: updating it would undo the
        freeze. Other memory state (DGC's momentum) restarts with the new layout.
        """
        for run in old.runs:
            if run.first >= len(old.compressed):  # the dense buckets keep no residual
                break
            e = self._run_residual(old, run)
            if e is None:
                continue
            for p, part in split_flat(e, run.bucket.params):
                piece = part.to(p.dtype)
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    p.grad = piece.clone()
                elif p.grad.is_sparse:  # it takes its residual densely, and the step is
                    self._note_sparse([p])  # refused on every rank all the same
                    p.grad = piece + p.grad
                else:
                    p.grad = p.grad + piece
        self.memory.reset()

    def _note_sparse(self, params: Sequence[Tensor]) -> None:
        """Note the first of ``params`` with a sparse gradient (``nn.Embedding(sparse=True)``):
        the dense buckets launch it as zeros, and the step's scalars carry its index, so that
        :meth:`Engine.commit` refuses the step on every rank, also on a rank that had no
        gradient for it at all (raising here alone would leave that rank waiting in the
        step's collectives)."""
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                index = self._index(p)
                self._sparse = index if self._sparse < 0 else min(self._sparse, index)

    def _params(self) -> list[Tensor]:
        """The wrapped optimizer's parameters, in group order."""
        return [p for g in self.param_groups for p in g["params"]]

    def _index(self, p: Tensor) -> int:
        """``p``'s index among :meth:`_params`."""
        return next(i for i, q in enumerate(self._params()) if q is p)

    def _sparse_error(self, index: int, who: str) -> ValueError:
        """The refusal of a sparse gradient for parameter ``index``, which ``who`` had: the
        buckets are dense, and a densified gradient would reach the wrapped optimizer dense
        (``SparseAdam`` refuses it) with a dense residual the size of the whole table."""
        shape = tuple(self._params()[index].shape)
        return ValueError(
            f"parameter {index} (shape {shape}) has a gradient of layout torch.sparse_coo on "
            f"{who} (nn.Embedding or nn.EmbeddingBag with sparse=True), and GravacOptimizer "
            "takes torch.strided (dense) gradients only: make the layer dense (sparse=False, "
            "with a dense optimizer such as Adam for SparseAdam), or leave that parameter out "
            "of the optimizer gravac wraps (DistributedDataParallel with "
            "gravac.ddp.gravac_hook averages sparse gradients as sparse rows)"
        )

    def _run_residual(self, layout: Layout, run: Run) -> Tensor | None:
        """The residual of ``run``'s buffer as one flat tensor (a split tensor's pieces joined,
        a piece without one as zeros); ``None``: none of its buckets has one."""
        buckets = layout.buckets[run.first : run.stop]
        parts = [self.memory.residual(b.key) for b in buckets]
        hierarchy = self.engine.hierarchy
        if hierarchy is not None:  # a chunk's residual, as this rank's share of the bucket's
            parts = [
                None if e is None else hierarchy.spread(e, b.numel)
                for e, b in zip(parts, buckets, strict=True)
            ]
        known = [e for e in parts if e is not None]
        if not known:
            return None
        if len(parts) == 1:
            return known[0]
        return torch.cat(
            [
                known[0].new_zeros(n) if e is None else e.reshape(-1)
                for e, n in zip(parts, run.sizes, strict=True)
            ]
        )

    # ------------------------------------------------------------------ uneven inputs
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For ``with torch.distributed.algorithms.Join([opt]):`` around a loop whose ranks
        take different numbers of steps (uneven inputs): a rank that ran out of data takes
        each of the others' steps with no gradient of its own (zeros in the average, as
        under DDP's ``Join``), and at the end every rank takes the parameters of one that
        trained last."""
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.comm.device

    @property
    def join_process_group(self) -> Any:
        return self.comm.group

    def close(self) -> None:
        """Flush and close the monitor, then wait for every rank (a collective: call it on every
        rank). A rank that destroys its gloo process group while another rank still uses it can
        abort at exit, so ``opt.close(); dist.destroy_process_group()`` tears down together."""
        self.engine.close_monitor()
        self._unhook()
        if self.comm.distributed and dist.is_initialized():
            dist.barrier(group=self.comm.group)

    def __repr__(self) -> str:
        return (
            f"GravacOptimizer({type(self.optimizer).__name__}, compressor={self.compressor!r}, "
            f"policy={self.engine.policy!r}, world_size={self.comm.world_size})"
        )


class _JoinHook(JoinHook):
    """The step a joined rank takes for each of the others' (:meth:`GravacOptimizer.join_hook`):
    a whole step with no gradient of its own, so that its collectives match theirs and the
    engine (residuals, search, counters) moves with them; the wrapped optimizer applies the
    same aggregate. Once all have joined, every rank takes the parameters (and the buffers of
    ``sync_buffers``) of one that trained last: a joined rank's learning rate schedule may
    have stopped with its loop."""

    def __init__(self, opt: GravacOptimizer) -> None:
        self.opt = opt

    def main_hook(self) -> None:
        opt = self.opt
        opt._shadowing = True
        try:
            opt.zero_grad(set_to_none=True)
            opt.step()
        finally:
            opt._shadowing = False

    def post_hook(self, is_last_joiner: bool) -> None:
        opt = self.opt
        if opt.comm.world_size == 1:
            return
        mine = dist.get_rank() if is_last_joiner else -1
        src = opt.comm.all_reduce_async(torch.tensor([mine], device=opt.comm.device), "max")
        held = [p.data for p in opt._params()]
        if opt.sync_buffers is not None:
            held += list(opt.sync_buffers.buffers())
        opt.comm.broadcast_(held, src=int(src.wait()))


def _stamp(p: Tensor) -> tuple[int, int] | None:
    """The identity and in-place version of ``p.grad`` (``None`` without one)."""
    return None if p.grad is None else (id(p.grad), p.grad._version)


def _hold(flat: Tensor, bucket: Bucket) -> Callable[[], Tensor | None]:
    """How the optimizer holds ``bucket``'s buffer ``flat`` between steps: a bucket of one
    tensor weakly, by the tensor that owns ``flat``'s memory (``flat``, or the tensor it is a
    view of: a view's own object goes as soon as nobody holds it, its base lives as long as
    any view of it does, the gradient made of it included); a bucket of several strongly.

    One tensor's fresh gradient (after ``zero_grad(set_to_none=True)``) is taken as the next
    buffer uncopied (:func:`_sole_gradient`): a buffer held beside it would be one gradient
    more at the peak. Several tensors' fresh gradients are copied into the buffer and freed
    bucket by bucket, so holding it adds at most a bucket to the peak, where a new buffer at
    every step would fault its pages in anew (measured: Top-k's launch 3-5 ms slower a step
    on the vgg-digits CNN, docs/studies/2026-12-03-step-time.md)."""
    if len(bucket.params) > 1:
        return lambda: flat
    return weakref.ref(flat if flat._base is None else flat._base)


def _sole_gradient(bucket: Bucket) -> Tensor | None:
    """The gradient of ``bucket``'s one parameter, flat, where the optimizer may take it as the
    bucket's buffer (:meth:`GravacOptimizer._buffer`): a fresh dense gradient (after
    ``zero_grad(set_to_none=True)``, or the first backward) of the bucket's dtype, contiguous,
    outside autograd, that alone spans its storage, which no other tensor shares
    (:func:`gravac.kernels.buffers.is_sole`): nobody else sees the engine's work in it.
    ``None``: it must be copied into a buffer of the optimizer's."""
    if len(bucket.params) != 1:
        return None
    g = bucket.params[0].grad
    if (
        g is None
        or g.layout != torch.strided
        or g.dtype != bucket.dtype
        or g.requires_grad
        or not g.is_contiguous()
        or not is_sole(g)
    ):
        return None
    return g.view(-1)


def _params(layout: Layout, unit: Unit) -> tuple[Tensor, ...]:
    """The parameters of ``unit`` (a unit's slots index :attr:`Layout.params`)."""
    params = layout.params
    return tuple(params[i] for i in unit.slots)
