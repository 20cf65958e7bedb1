"""The step engine: one per-bucket pipeline behind both front ends (docs/design.md section 4).

:class:`gravac.GravacOptimizer` and the DDP comm hook (:mod:`gravac.ddp`) hand the engine flat
gradients, one *unit* at a time (a compressed bucket, or a dense one of 1-D tensors), as soon
as each is ready; the engine does the rest. For every step::

    begin:   plan = controller.plan(); decision = controller.decide(plan)
             (agreed through step t - 1, docs/design.md section 8: known before any gradient)
    launch:  x = g + e                                      (error feedback, per unit)
             X_min = C(x, theta_min); X_c = C(X_min, theta_c / theta_min)   (multi-level)
             local gain terms <c, x>, ||c||^2 (from the payload), ||x||^2
             e' = x - D(sent), in x's storage (settled now, kept at commit; where a tensor of
             the unit has no gradient, at commit), so nothing reads x or the payload later
             start the collective of what the decision names, an all-reduce in place (a
             future completes with the unit's aggregate at commit)
    close:   one small all-gather of the step's scalars [non-finite flag, step time, bound
             on |x|, has-gradient flags, gain terms], overlapped with the payloads in flight
    commit:  any rank non-finite: skip; else combine every unit's payloads into the mean
             over ranks in its ``out`` buffer (the front end's gradient buffer: no gradient-
             sized temporary); a non-finite mean: skip (a mean that the compressor bounds well
             inside the range, from the agreed bound on every rank's |x|, is not looked at:
             Compressor.mean_bound). A skip leaves residuals, compressor and controller
             untouched on every rank (aggregates NaN); else e <- e', fold the agreed gains and
             step time into the controller. A front end that hands its buffer over
             (``launch(own=True)``, the optimizer) has x formed in it; it becomes the residual
             and the mean lands in the old residual's storage: two gradient-sized buffers a
             unit, where a buffer of x's own would make three
    finish:  count and log the step; the controller's window rules

Units must be launched in the same order on every rank (collectives pair up by order). The
decision never waits for the step's own gains, so each unit's collective starts while backward
is still computing the next one's gradient; the only values exchanged per step besides the
payloads are those few scalars, in one asynchronous collective.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gravac.comm import Communicator, collect
from gravac.compressors.base import (
    Compressor,
    Context,
    Payload,
    Round,
    payload_tensors,
    wire_bytes,
)
from gravac.controller import Controller, ControllerConfig, Decision, Plan, cf_key
from gravac.gain import gain_from_terms, squared_norm
from gravac.memory import Memory, NoMemory, ResidualMemory
from gravac.monitor import Monitor, StepRecord, TensorBoardMonitor
from gravac.noise import signal_fraction, signal_payload
from gravac.policies.base import ScalingPolicy
from gravac.shadow import ShadowSums
from gravac.spans import Place, scatter_spans, spans_numel
from gravac.window import WindowSums

__all__ = ["Engine", "Outcome", "Step", "Unit", "all_finite"]

#: the step's local gain terms: <c_min, x>, ||c_min||^2, <c_c, x>, ||c_c||^2, ||x||^2, then
#: the window's <S, X>, ||S||^2, ||X||^2 (:mod:`gravac.window`, at a step that closes a window);
#: three more for each of the plan's shadow CFs follow them (:mod:`gravac.shadow`)
_TERMS = 8
#: where the window's terms start among them
_WINDOW_TERMS = 5
#: the scalars before the has-gradient flags: non-finite, stale, step interval, the previous
#: step's exposed communication seconds, and the bound on the magnitude of the step's inputs
_HEAD = 5
#: where the bound is among them
_BOUND = 4
#: an aggregate is known finite, without a pass over it, when the compressor bounds every value
#: it computes (:meth:`Compressor.mean_bound`) by the dtype's largest finite value over this:
#: the bounds leave out rounding (a factor ``1 + 2^-24`` per addition in float32, far from 2)
_BOUND_MARGIN = 2.0
#: what a step that compresses nothing sends
_DENSE = Decision(cf=1.0, which="dense")
#: keys of the pieces of a unit sent at per-layer CFs (:meth:`Engine._launch_layers`), apart
#: from every unit's key (compressors seed and keep state per key): base + key * stride + the
#: index of the piece's first tensor (and the default layer ids of :attr:`Unit.layers`)
_PIECE_KEY_BASE = 1 << 40
_PIECE_KEY_STRIDE = 1 << 20


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of every tensor is finite, with one host sync.

    From each tensor's minimum and maximum (``aminmax`` propagates NaN, and an Inf is one of
    them): one reduction without a boolean copy, 25x faster than ``isfinite(t).all()`` on 2M
    float32 elements on one CPU thread (0.26 against 6.8 ms).
    """
    return _ends_finite([_ends(t) for t in tensors])


def _n_terms(plan: Plan) -> int:
    """How many gain terms a step of ``plan`` carries (:data:`_TERMS`)."""
    return _TERMS + 3 * len(plan.shadows)


def _shadow_gains(plan: Plan, terms: Tensor) -> dict[float, float]:
    """The window gain of each of ``plan.shadows`` from the step's agreed ``terms``."""
    return {
        cf: gain_from_terms(terms[_TERMS + 3 * i : _TERMS + 3 * i + 3])
        for i, cf in enumerate(plan.shadows)
    }


def _ends(t: Tensor) -> Tensor:
    """``[min, max]`` of ``t``, in float64 (NaN if ``t`` holds one); empty for an empty ``t``
    (``aminmax`` has no identity)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.float64, device=t.device)
    return torch.stack(torch.aminmax(t.detach().reshape(-1))).to(torch.float64)


def _ends_finite(ends: Sequence[Tensor]) -> bool:
    if not ends:
        return True
    return bool(torch.isfinite(torch.cat([e.to(ends[0].device) for e in ends])).all())


@dataclass(frozen=True)
class Unit:
    """One flat tensor the engine aggregates.

    Attributes:
        key: the residual and seed key, identical on every rank (compressed units).
        shapes: the tensors packed into it, in order (:attr:`Round.layout`).
        compressed: compressed at the planned CFs, or all-reduced dense (1-D tensors).
        slots: positions of its tensors in the step's has-gradient flags (:meth:`Engine.close`);
            empty when the front end has no such flags (every tensor has a gradient).
        layers: a stable id for each of its tensors, identical on every rank and in every run
            of one model (per-layer decisions are keyed by them); empty: ids made of the unit's
            key and the tensors' indices.
    """

    key: int
    shapes: tuple[torch.Size, ...]
    compressed: bool
    slots: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """:attr:`layers`, or ids made of :attr:`key` when the front end gives none."""
        return self.layers or tuple(
            _PIECE_KEY_BASE + self.key * _PIECE_KEY_STRIDE + i for i in range(len(self.shapes))
        )

    @property
    def numel(self) -> int:
        """Elements in the unit."""
        return sum(self.numels)

    @property
    def numels(self) -> tuple[int, ...]:
        """Elements in each of its tensors."""
        return tuple(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class _Piece:
    """Elements ``start:end`` of a unit, compressed and sent on their own (per-layer CFs)."""

    start: int
    end: int
    payload: Payload
    ctx: Context
    arrived: Future[Any]  # every rank's payload


@dataclass
class _Flight:
    """One launched unit: what it compressed, what it sent, and the aggregate to come."""

    unit: Unit
    x: Tensor  # the error-fed gradient (the gradient itself for a dense unit)
    sent: tuple[Payload, Context] | None  # the payload sent; None: x dense, or pieces
    arrived: Future[Any]  # the collective: the all-reduced x, or every rank's payload(s)
    wire_bytes: int
    out: Tensor | None  # where the aggregate is written (None: a new tensor)
    result: Future[Tensor] = field(default_factory=Future)  # the aggregate, set at commit
    pieces: tuple[_Piece, ...] = ()  # per-layer CFs: what each piece sent
    # the new residual, settled at launch in x's storage (Memory.settle; None: made at commit)
    residual: Tensor | None = None
    taken: list[Tensor] | None = None  # the window's sample of x, taken before settling
    shadow: Tensor | None = None  # the sampled gradient, for the plan's shadow CFs
    # x is in the front end's buffer and becomes the residual: the aggregate goes into the old
    # residual's storage at commit (out, still x's, receives a skipped step's NaN)
    rotate: bool = False
    # where a rotating aggregate goes when there is no old residual yet (None: a new tensor)
    spare: Tensor | None = None
    # the buffer and spans the aggregate is laid into (Engine.launch's place); None: flat
    place: Place | None = None

    @property
    def dense(self) -> bool:
        """Whether ``x`` itself was sent, uncompressed."""
        return self.sent is None and not self.pieces

    @property
    def sent_elements(self) -> float:
        """float32 elements' worth of what was sent."""
        if self.pieces:
            return sum((p.end - p.start) / p.ctx.achieved_cf for p in self.pieces)
        if self.sent is None:
            return self.unit.numel
        return self.unit.numel / self.sent[1].achieved_cf


@dataclass
class Step:
    """One step in flight, from :meth:`Engine.begin` to :meth:`Engine.finish`.

    Attributes:
        index: the engine's step count when the step began (seeds shared randomness).
        plan: the CFs compressed at (controller's plan).
        decision: what is sent (controller's decision, from earlier steps' values).
        snapshot: the compressor's state before the step, restored if it is skipped.
        flights: the launched units, in launch order.
        ends: each gradient's [min, max] (or the compressor's statistics of it, where they
            show a non-finite value), for the non-finite flag.
        bounds: per compressed unit, a bound on ``max |x|`` (float64; ``inf``: none known).
        terms: the local gain terms, summed over the compressed units (float64).
        compress_seconds: time spent compensating, compressing and computing gain terms.
        closed_at: the clock at :meth:`Engine.close`; ``None`` before.
        scalars: every rank's scalars (set by :meth:`Engine.close`).
        flags: how many has-gradient flags this step's scalars carry (set by :meth:`Engine.close`).
        values: how many controller values they carry (set by :meth:`Engine.close`).
        stats: each unit's (or piece's) layers and local compressor statistics, to agree with
            the scalars for the next step (compressors whose statistics may lag).
        totals: each compressed tensor's sampled window sum ``X`` (a plan with ``signal``, at
            the step that closes a window), summed over ranks at :meth:`Engine.close`.
        signal: that sum (set by :meth:`Engine.close`).
    """

    index: int
    plan: Plan
    decision: Decision
    snapshot: dict[str, Any]
    flights: list[_Flight] = field(default_factory=list)
    ends: list[Tensor] = field(default_factory=list)
    bounds: list[Tensor] = field(default_factory=list)
    terms: Tensor = field(default_factory=lambda: torch.zeros(_TERMS, dtype=torch.float64))
    compress_seconds: float = 0.0
    closed_at: float | None = None
    scalars: Future[list[Tensor]] | None = None
    flags: int = 0
    values: int = 0
    stats: list[tuple[tuple[int, ...], Tensor]] = field(default_factory=list)
    totals: list[Tensor] = field(default_factory=list)
    signal: Future[Tensor] | None = None


@dataclass(frozen=True)
class Outcome:
    """A committed step: each unit's aggregate, or a skip.

    Attributes:
        skipped: the step is skipped on every rank (non-finite values); nothing else is set.
        grads: each unit's aggregate divided by the world size, in launch order (for a unit
            launched with ``place``: a flat buffer for the front end to reuse, the aggregate
            being laid into the place).
        present: for each has-gradient flag, whether some rank had that gradient.
        record: what the step did (logged by :meth:`Engine.finish`).
        search: whether the step took part in the controller's search (something compressed).
    """

    skipped: bool
    grads: tuple[Tensor, ...] = ()
    present: tuple[bool, ...] = ()
    record: StepRecord | None = None
    search: bool = False


_SKIP = Outcome(skipped=True)


class Engine:
    """The state and pipeline of a step, shared by the optimizer and the DDP hook.

    Build it with :func:`gravac.options.build_engine`, which validates the arguments.

    Args:
        compressor: compresses each unit at the planned CFs.
        policy: the controller's scaling policy.
        config: the controller's hyperparameters.
        memory: the error-feedback memory (residuals, DGC's momenta), keyed by unit key.
        comm: the process group.
        batch_size: samples per rank per step (``None``: throughput counted in steps).
        nonfinite: ``"skip"`` or ``"raise"`` for a non-finite gradient or aggregate.
        monitor: a :class:`Monitor`, a ``SummaryWriter`` or a log directory, opened on rank 0
            once the rank is known; or ``None``.
        clock: seconds, for step times (tests inject a deterministic one).
    """

    def __init__(
        self,
        compressor: Compressor,
        policy: ScalingPolicy,
        config: ControllerConfig,
        memory: Memory,
        comm: Communicator,
        *,
        batch_size: int | None,
        nonfinite: str,
        monitor: Any,
        clock: Callable[[], float],
    ) -> None:
        self.compressor = compressor  # compresses every compressed unit
        self.comm = comm  # the process group the units are aggregated in
        self.memory = memory  # error-feedback residuals, by unit key
        self.controller = self._make_controller(config, policy)  # decides the CFs
        self.batch_size = batch_size  # samples per rank per step, for system throughput
        self.nonfinite = nonfinite  # "skip" or "raise"
        self.monitor: Monitor | None = None  # rank 0's step log (other ranks: None)
        self._monitor_spec = monitor  # what to open as the monitor, until it is opened
        if comm.distributed:
            self._open_monitor()
        self.clock = clock  # seconds
        self.steps = 0  # steps taken (skipped ones not counted)
        self.skipped_steps = 0  # steps skipped on every rank
        self.total_wire_bytes = 0  # bytes sent by this rank over all steps taken
        self.total_dense_wire_bytes = 0  # what float32 all-reduces would have sent
        self.last_record: StepRecord | None = None  # the last step taken
        self.last_cf: float | None = None  # CF sent at the previous step (None: not searching)
        self.last_close: float | None = None  # the clock at the previous step's close()
        self.last_comm = -1.0  # the previous step's exposed communication seconds (-1: none)
        self._alone = 0  # steps this process took, or skipped, as a single worker
        # compressor statistics agreed at the last step, by the layers of their unit or piece
        # (compressors whose statistics may lag, under error feedback)
        self._lagged: dict[tuple[int, ...], Tensor] = {}
        # what each compressed tensor sent over the controller's current window (sampled)
        self.windows = WindowSums()
        # the shadow residuals and sums of the CFs the controller judges unsent (sampled)
        self.shadows = ShadowSums()

    # ------------------------------------------------------------------ the group
    def join_group(self) -> None:
        """Join the default process group if it appeared after construction (the HF Trainer
        creates it inside ``TrainingArguments``); never step as one worker while it exists.
        Opens the monitor on rank 0.

        Raises:
            RuntimeError: the group appeared after this engine had already stepped alone.
        """
        if not self.comm.distributed and dist.is_available() and dist.is_initialized():
            if self._alone:
                raise RuntimeError(
                    f"torch.distributed was initialised after gravac took {self._alone} "
                    "step(s) as a single worker; create the optimizer or hook state (or call "
                    "its first step) after init_process_group"
                )
            self.comm = Communicator(None)
            self.controller = self._make_controller(self.controller.config, self.controller.policy)
        self._open_monitor()

    def bind_shapes(self, shapes: Sequence[torch.Size]) -> None:
        """The shapes of every compressed tensor, in unit order (the front ends call it when
        the layout is known or changes): the compressor plans its deliverable CFs over them
        and the controller snaps what it holds to those."""
        self.compressor.bind_shapes(shapes)
        self.controller.resnap()

    def _make_controller(self, config: ControllerConfig, policy: ScalingPolicy) -> Controller:
        """A controller that plans only CFs this compressor delivers at this world size."""
        world, c = self.comm.world_size, self.compressor
        replayable = c.shadowable and type(self.memory) is ResidualMemory
        controller = policy.make_controller(
            config, world, lambda cf: c.deliverable_cf(cf, world), replayable=replayable
        )
        if controller.plans_shadows and not replayable:
            raise ValueError(
                f"policy option search='shadow' needs a compressor whose sends can be replayed "
                f"on a sample under plain error feedback (topk, redsync), got {c.name!r} with "
                f"{type(self.memory).__name__}; use search='trial'"
            )
        shadow_only = [f"horizon={policy.horizon}"] if (policy.horizon or 1) > 1 else []
        shadow_only += ["noise=True"] if policy.noise else []
        if shadow_only and not controller.plans_shadows:
            raise ValueError(
                f"policy option {' and '.join(shadow_only)} needs the search by shadow, which "
                f"{c.name!r} with {type(self.memory).__name__} cannot run (a compressor whose "
                "sends can be replayed under plain error feedback: topk, redsync); leave "
                "horizon at 1 and noise unset"
            )
        return controller

    def _open_monitor(self) -> None:
        """Open the monitor on rank 0, once."""
        spec, self._monitor_spec = self._monitor_spec, None
        if spec is None or self.comm.rank != 0:
            return
        self.monitor = cast(Monitor, spec) if hasattr(spec, "log") else TensorBoardMonitor(spec)

    def close_monitor(self) -> None:
        """Flush and close the monitor (rank 0)."""
        if self.monitor is not None:
            self.monitor.close()

    # ------------------------------------------------------------------ per step
    def begin(self, lr: float | None = None) -> Step:
        """Start a step: the plan and the decision, from values agreed at earlier steps.

        Args:
            lr: the wrapped optimizer's learning rate (Accordion reacts to its decays).
        """
        self.controller.note_lr(lr)
        plan = self.controller.plan()
        snapshot = copy.deepcopy(self.compressor.state_dict())
        terms = torch.zeros(_n_terms(plan), dtype=torch.float64)
        return Step(self.steps, plan, self.controller.decide(plan), snapshot, terms=terms)

    def launch(
        self,
        step: Step,
        unit: Unit,
        flat: Tensor,
        out: Tensor | None = None,
        carry: Tensor | None = None,
        complete: bool = True,
        own: bool = False,
        packed: bool = False,
        spare: Tensor | None = None,
        place: Place | None = None,
    ) -> Future[Tensor]:
        """Compensate, compress and start aggregating one unit's flat gradient ``flat`` (which
        the engine does not modify, unless ``own``).

        Args:
            out: a flat tensor of the unit's size and ``flat``'s dtype to receive the aggregate
                at :meth:`commit` instead of a new tensor, ``flat`` itself included (the front
                ends pass the gradients' own flat buffer: no gradient-sized temporary).
            carry: residual pieces carried over from units that no longer exist (the DDP
                hook's, after a bucket rebuild or a resume), added to a compressed unit's
                gradient before compensation; per-layer statistics see the gradient alone.
            complete: every tensor of the unit has a gradient on this rank, so none can be
                absent on every rank (the residual update is then settled before the send,
                :meth:`Memory.settle`); ``False``: a missing one is zeros in ``flat``.
            own: the front end gives ``flat`` (which must be ``out``) to the engine until
                commit: a compressed unit's error-fed gradient is formed in it
                (:meth:`Memory.compensate_`) and, where a compressed payload is sent and the
                residual settled, ``flat`` becomes the residual and the aggregate is written
                into the old residual's storage (a new tensor at the first step). The front
                end then keeps the future's tensor as its gradient buffer: the unit holds two
                gradient-sized buffers (``flat`` and the residual), not three (one for ``x``).
            packed: ``flat`` already holds the gradient plus what :meth:`addend` returned
                for it (which then was a tensor): it is ``x``, compensated as it was written.
            spare: with ``own``, a flat tensor of the unit's size and dtype for the aggregate
                where the unit has no residual yet whose storage it would take (the first
                step): a front end that keeps several units' aggregates side by side (the
                pieces of a split tensor) passes slices of one buffer. ``None``: a new tensor.
            place: ``(buffer, spans)``: lay the aggregate into ``buffer``'s ``spans`` at commit
                (:mod:`gravac.spans`; a DDP bucket that mixes this unit's tensors with others),
                written there by the compressor where it can
                (:meth:`Compressor.combine_mean_placed`), not copied from a flat aggregate.
                The future then completes with a flat tensor of the unit's size that the
                engine no longer needs, the front end's to reuse (the next ``flat``).

        Returns:
            A future that :meth:`commit` completes with the unit's aggregate (the mean over
            ranks of what was sent; with ``place``, see there), or with NaN where the step is
            skipped.
        """
        if own and out is not flat:
            raise ValueError("Engine.launch(own=True) needs out to be flat itself")
        if place is not None and spans_numel(place[1]) != unit.numel:
            raise ValueError(
                f"Engine.launch(place=...) needs spans of the unit's {unit.numel} elements, "
                f"got {place[1]}"
            )
        if packed and not (own and self._packable(step, unit, complete, carry is not None)):
            raise ValueError(
                "Engine.launch(packed=True) needs a unit that addend() returned a tensor for "
                "(own=True, complete, no carry)"
            )
        t0 = self.clock()
        if not unit.compressed:  # no local check: the all-reduced sum, checked at commit, is
            # non-finite on every rank where an element is on one (NaN and Inf propagate)
            x = flat if out is flat else flat.clone()  # all-reduced in place
            flight = _Flight(unit, x, None, self.comm.all_reduce_async(x), _nbytes(x), out)
        else:
            flight = self._launch_compressed(
                step, unit, flat, out, carry, settle=complete, own=own, packed=packed
            )
            flight.spare = spare
        flight.place = place
        step.flights.append(flight)
        step.compress_seconds += self.clock() - t0
        return flight.result

    def needs_spare(self, step: Step, unit: Unit) -> bool:
        """Whether :meth:`launch` with ``own`` would put ``unit``'s aggregate into a new tensor
        at commit: it sends a compressed payload under error feedback but has no residual yet
        whose storage the aggregate would take (see ``spare``)."""
        return (
            unit.compressed
            and step.decision.which != "dense"
            and not isinstance(self.memory, NoMemory)
            and self.memory.residual(unit.key) is None
        )

    def addend(
        self, step: Step, unit: Unit, flat: Tensor, *, complete: bool = True, carry: bool = False
    ) -> Tensor | None:
        """What a front end that hands ``flat`` over (:meth:`launch` with ``own``) may add to
        the gradients as it writes them into ``flat``, so that it holds ``x = g + e`` without
        a pass of its own (:meth:`Memory.addend`); it then launches with ``packed=True``.

        ``None``: it writes the gradients alone and :meth:`launch` compensates them. That is
        the case for a dense unit, one with a missing gradient (``complete=False``) or residual
        pieces to ``carry`` in, per-layer CFs, a controller that reads the gradient alone
        (:attr:`Controller.tracks_gradients`), a memory that keeps more than a residual, and
        the first step.
        """
        if not self._packable(step, unit, complete, carry):
            return None
        return self.memory.addend(unit.key, flat)

    def _packable(self, step: Step, unit: Unit, complete: bool, carry: bool) -> bool:
        """Whether :meth:`launch` may take ``unit`` packed (see :meth:`addend`)."""
        if not unit.compressed or not complete or carry or self.controller.tracks_gradients:
            return False
        return len(set(step.plan.cfs_for(unit.layer_ids))) == 1

    def _launch_compressed(
        self,
        step: Step,
        unit: Unit,
        flat: Tensor,
        out: Tensor | None,
        carry: Tensor | None,
        *,
        settle: bool,
        own: bool,
        packed: bool,
    ) -> _Flight:
        c, plan = self.compressor, step.plan
        self.controller.track(unit.layer_ids, flat, unit.numels)
        # every tensor has a gradient here: nothing reads x after the send (the residual update
        # is settled now, or a dense send zeroes it), so the window's sample is taken first
        early = settle and carry is None
        layer_cfs = plan.cfs_for(unit.layer_ids)
        per_layer = len(set(layer_cfs)) > 1
        if packed:
            x: Tensor | None = flat
        else:
            in_place = own and early and not per_layer
            x = self.memory.compensate_(unit.key, flat) if in_place else None
        in_flat = x is not None
        if x is None:
            x = self.memory.compensate(unit.key, flat if carry is None else flat + carry)
        if per_layer:
            return self._launch_layers(step, unit, x, layer_cfs, out)
        cf_min = layer_cfs[0]
        world = self.comm.world_size
        base = Round(step=step.index, key=unit.key, world_size=world, layout=unit.shapes)
        direct = plan.candidate is not None and not c.supports_multilevel
        cfs = [cf_min]
        if direct and plan.candidate is not None:
            cfs.append(plan.candidate)
        r_min, *r_c = self._agree_stats(step, x, cfs, base, unit.layer_ids)
        p_min, ctx_min = c.compress(x, cf_min, r_min)
        chosen = (p_min, ctx_min)
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        terms = [*c.sent_terms(x, p_min, ctx_min)] if plan.measure else [zero, zero]
        if plan.candidate is not None:
            if direct:
                p_c, ctx_c = c.compress(x, plan.candidate, r_c[0])
            else:
                p_c, ctx_c = c.recompress(p_min, ctx_min, plan.candidate, r_min)
            terms += [*c.sent_terms(x, p_c, ctx_c)]
            if step.decision.which == "candidate":
                chosen = (p_c, ctx_c)
        else:
            terms += [zero, zero]
        # x = g + e with a finite residual: x is finite exactly when g is, and ||x||^2 is NaN
        # or Inf exactly when x is not (float64 where float32 overflows): the non-finite flag
        if plan.measure:
            xx = squared_norm(x)
            step.ends.append(xx.reshape(1))
            step.bounds.append(xx.sqrt().reshape(1))  # ||x||_inf <= ||x||_2
            terms.append(xx)
        elif not (c.sends_input or c.stats_show_nonfinite):
            ends = _ends(x)
            step.ends.append(ends)
            step.bounds.append(ends.abs().amax(dim=0, keepdim=True) if ends.numel() else ends)
            terms.append(zero)
        else:  # its aggregate, a plain sum, is checked at commit, or its statistics were
            step.bounds.append(torch.full((1,), math.inf, dtype=torch.float64, device=x.device))
            terms.append(zero)
        e = None  # the residual x holds: still the previous step's, until commit
        if (plan.window_terms and self._windowed) or plan.shadows:
            e = self.memory.residual(unit.key)
            if carry is not None:
                e = carry if e is None else e + carry
        if plan.window_terms and self._windowed:
            totals = step.totals if plan.signal else None
            window = self.windows.terms(unit.layer_ids, unit.numels, e, totals).to(x.device)
            shadows = self.shadows.terms(plan.shadows, unit.layer_ids, unit.numels)
        else:
            window = torch.zeros(3, dtype=torch.float64, device=x.device)
            shadows = torch.zeros(3 * len(plan.shadows), dtype=torch.float64)
        local = [torch.stack(terms), window, shadows.to(x.device)]
        step.terms = step.terms.to(x.device) + torch.cat(local)
        taken = self.windows.taken(x, unit.numels) if early and self._sums(plan) else None
        shadow = self.shadows.gradient(x, e, unit.numels) if plan.shadows else None
        if step.decision.which == "dense":
            total = x if early else x.clone()  # all-reduced in place
            reduced = self.comm.all_reduce_async(total)
            flight = _Flight(unit, x, None, reduced, _nbytes(total), out, taken=taken)
            flight.shadow = shadow
            return flight
        payload, ctx = chosen
        residual = None
        if early and not _aliases(payload, x):
            residual = self.memory.settle(unit.key, x, c, payload, ctx)
        gathered = self._send(payload, read_later=residual is None)
        nbytes = wire_bytes(payload)
        if in_flat and residual is None:  # x, in flat, is read at commit: the aggregate goes
            out = None  # into a new tensor
        rotate = in_flat and residual is not None
        return _Flight(
            unit,
            x,
            chosen,
            gathered,
            nbytes,
            out,
            residual=residual,
            taken=taken,
            shadow=shadow,
            rotate=rotate,
        )

    def _send(self, payload: Payload, *, read_later: bool = True) -> Future[Any]:
        """Start the compressor's collective of ``payload``; an all-reduce sums into the payload
        itself unless the residual update still reads it at commit (``read_later``, under error
        feedback)."""
        in_place = not read_later or isinstance(self.memory, NoMemory)
        return self.comm.send_payload(payload, self.compressor.collective, in_place=in_place)

    def _sums(self, plan: Plan) -> bool:
        """Whether what a unit sends this step is added to the window's sums (not at the step
        that closes a window, which starts the next one; not with per-layer CFs)."""
        return self._windowed and not plan.window_terms and not plan.per_layer

    def _launch_layers(
        self, step: Step, unit: Unit, x: Tensor, cfs: tuple[float, ...], out: Tensor | None
    ) -> _Flight:
        """Send a unit whose tensors have CFs of their own (per-layer decisions): each run of
        adjacent tensors at one CF is a piece, a view of ``x`` compressed and sent on its own.
        No gains are measured (a per-layer policy reads none)."""
        c, world = self.compressor, self.comm.world_size
        step.ends.append(_ends(x))
        pieces = []
        for first, last, start, end in _runs(unit.shapes, cfs):
            key = _PIECE_KEY_BASE + unit.key * _PIECE_KEY_STRIDE + first
            base = Round(step.index, key, world, layout=unit.shapes[first:last])
            piece = x[start:end]
            (rnd,) = self._agree_stats(step, piece, [cfs[first]], base, unit.layer_ids[first:last])
            payload, ctx = c.compress(piece, cfs[first], rnd)
            pieces.append(_Piece(start, end, payload, ctx, self._send(payload)))
        arrived = collect([p.arrived for p in pieces])
        nbytes = sum(wire_bytes(p.payload) for p in pieces)
        return _Flight(unit, x, None, arrived, nbytes, out, pieces=tuple(pieces))

    @property
    def _windowed(self) -> bool:
        """Whether window gains are measured: under error feedback (without it, what a step
        does not send is lost, and the per-step gain is the window's)."""
        return not isinstance(self.memory, NoMemory)

    @property
    def _stats_lag(self) -> bool:
        """Whether the compressor's statistics may be the previous step's: it allows it, and
        error feedback keeps what a stale scale clamps."""
        return self.compressor.stats_may_lag and not isinstance(self.memory, NoMemory)

    def _agree_stats(
        self, step: Step, x: Tensor, cfs: list[float], base: Round, layers: tuple[int, ...]
    ) -> list[Round]:
        """One round per CF, with the compressor's statistics reduced over ranks: one blocking
        collective for all of them; none for compressors without statistics, nor for those
        whose statistics may lag once a step has agreed them (:attr:`_lagged`)."""
        c = self.compressor
        stats = [c.local_stats(x, cf, base) for cf in cfs]
        present = [s for s in stats if s is not None]
        if not present:
            return [base] * len(cfs)
        flat = torch.cat([s.reshape(-1).to(torch.float64) for s in present])
        if c.stats_show_nonfinite:  # the non-finite check of x, without a pass of its own
            step.ends.append(flat.clone())
        stale = False
        if self._stats_lag:
            step.stats.append((layers, flat))
            lagged = self._lagged.get(layers)
            stale = lagged is not None and lagged.numel() == flat.numel()
            if stale and lagged is not None:
                flat = lagged
        if not stale:
            self.comm.all_reduce_([flat], op=c.stats_op)
        out, offset = [], 0
        for s in stats:
            if s is None:
                out.append(base)
                continue
            agreed = flat[offset : offset + s.numel()].view(s.shape).to(s.dtype)
            offset += s.numel()
            out.append(dataclasses.replace(base, agreed=agreed, stale=stale))
        return out

    def close(self, step: Step, has_grad: Sequence[bool] = (), stale: bool = False) -> Future[Any]:
        """Start agreeing the step's scalars (after the last :meth:`launch`); the future
        completes once they and every unit's aggregate have arrived.

        Args:
            step: the step, every unit launched.
            has_grad: per tensor, whether this rank has its gradient (:attr:`Unit.slots`).
            stale: this rank changed a gradient after it was launched; :meth:`commit` then
                raises on every rank (a change the aggregate does not hold would be lost).
        """
        now = self.clock()
        interval = -1.0 if self.last_close is None else now - self.last_close
        self.last_close = now
        step.closed_at = now
        step.flags = len(has_grad)
        local_bad = not _ends_finite(step.ends)
        bounds = [b.reshape(-1) for b in step.bounds if b.numel()]
        device = bounds[0].device if bounds else None
        bound = float(torch.cat([b.to(device) for b in bounds]).max()) if bounds else 0.0
        scalars = [local_bad, stale, interval, self.last_comm, bound, *has_grad]
        head = torch.tensor(scalars, dtype=torch.float64)
        values = torch.tensor(self.controller.local_values(), dtype=torch.float64)
        step.values = len(values)
        stats = [s.cpu() for _, s in step.stats]
        local = torch.cat([head, step.terms.cpu(), values, *stats]).to(self.comm.device)
        step.scalars = self.comm.all_gather_async(local)
        waits: list[Future[Any]] = [step.scalars, *(f.arrived for f in step.flights)]
        if step.totals:
            payload = signal_payload(step.totals).to(self.comm.device)
            step.signal = self.comm.all_reduce_async(payload)
            waits.append(step.signal)
        return collect(waits)

    def commit(self, step: Step) -> Outcome:
        """Apply a step whose :meth:`close` future has completed: update the residuals and fold
        the agreed values into the controller, or skip it on every rank.

        Raises:
            FloatingPointError: ``nonfinite="raise"`` and some value was not finite.
            RuntimeError: some rank changed a gradient after it was launched.
        """
        if step.scalars is None or step.closed_at is None:
            raise RuntimeError("Engine.commit() needs a step closed by Engine.close()")
        table = torch.stack(step.scalars.value()).cpu()
        comm_seconds = self.clock() - step.closed_at
        if table[:, 1].max() > 0:
            self.compressor.load_state_dict(step.snapshot)
            stale = [r for r in range(table.shape[0]) if table[r, 1] > 0]
            error = RuntimeError(
                f"rank(s) {stale} changed a gradient after its bucket had been sent during "
                "backward(), so the change would be lost: call opt.synchronize() before "
                "working on gradients (clipping, unscaling), accumulate inside opt.no_sync(), "
                "or pass overlap=False"
            )
            for f in step.flights:
                f.result.set_exception(error)  # type: ignore[arg-type]  # stub types it as T
            raise error
        if table[:, 0].max() > 0:
            return self._skip(step)
        bound = float(table[:, _BOUND].max())
        vouched = [self._vouched(f, bound) for f in step.flights]
        # first the aggregates that must be checked, into buffers a skip may overwrite
        checked = {
            i: self._aggregate(f, None if f.rotate else f.out)
            for i, (f, v) in enumerate(zip(step.flights, vouched, strict=True))
            if not v
        }
        if not all_finite(list(checked.values())):
            return self._skip(step)
        totals = []
        for i, f in enumerate(step.flights):
            target = self._target(f)  # swaps a rotating flight's residual in, vouched or not
            if f.place is None:
                totals.append(checked[i] if i in checked else self._aggregate(f, target))
            else:
                totals.append(self._lay(f, target, checked.get(i)))
        self.last_comm = comm_seconds  # agreed with the next step's scalars
        n_flags = step.flags
        flags = _HEAD + n_flags
        present = tuple(bool(v) for v in (table[:, _HEAD:flags].max(dim=0).values > 0))
        n_terms = _n_terms(step.plan)
        terms = table[:, flags : flags + n_terms].sum(dim=0)
        for f in step.flights:
            if f.unit.compressed:
                self._update_residual(f, present, step.plan)
            if f.shadow is not None:
                self._replay(f, step.plan)
        if step.plan.window_terms:
            keep = self.controller.horizon - 1  # windows the next gains span too
            self.windows.clear(keep)
            self.shadows.clear(keep)
        compressed = [f for f in step.flights if f.unit.compressed]
        plan, decision = step.plan, step.decision
        if not compressed:  # nothing to compress: no gains, no search
            plan, decision = Plan(theta_min=plan.theta_min, candidate=None, measure=False), _DENSE
        gain_min = gain_from_terms(terms[[0, 1, 4]]) if plan.measure else math.nan
        gain_c = None
        if plan.candidate is not None and plan.measure:
            gain_c = gain_from_terms(terms[[2, 3, 4]])
        gain_w, shadow_gains, share = math.nan, {}, None
        if plan.window_terms and plan.shadows:
            shadow_gains = _shadow_gains(plan, terms)
        if plan.window_terms and self._windowed:
            gain_w = gain_from_terms(terms[_WINDOW_TERMS:_TERMS])
        if compressed:
            interval, exposed = float(table[:, 2].max()), float(table[:, 3].max())
            samples = (self.batch_size or 1) * self.comm.world_size
            if interval > 0 and self.last_cf is not None:
                self.controller.record_throughput(self.last_cf, samples / interval)
            if exposed >= 0 and self.last_cf is not None:
                self.controller.record_comm(self.last_cf, exposed / samples)
            start = flags + n_terms
            self.controller.observe_values(table[:, start : start + step.values])
            self._keep_stats(step, table[:, start + step.values :])
            if plan.window_terms:
                if step.signal is not None:
                    share = signal_fraction(step.signal.value().cpu(), self.comm.world_size)
                    self.controller.observe_signal(share)
                self.controller.observe_window(plan, gain_w)
                if shadow_gains:
                    self.controller.observe_shadows(plan, shadow_gains)
            self.controller.observe(plan, gain_min, gain_c)
        step_bytes = sum(f.wire_bytes for f in step.flights)
        dense_bytes = 4 * sum(f.unit.numel for f in step.flights)
        ctl, cf = self.controller, decision.cf
        record = StepRecord(
            step=step.index,
            phase=ctl.phase.value,
            cf_sent=_achieved_cf(compressed) if plan.per_layer else cf,
            cf_achieved=_achieved_cf(compressed),
            sent=decision.which,
            theta_min=plan.theta_min,
            cf_candidate=plan.candidate,
            gain_min=ctl.smoothed_gain(plan.theta_min),
            gain_candidate=None if plan.candidate is None else ctl.smoothed_gain(plan.candidate),
            gain_min_step=gain_min,
            gain_candidate_step=gain_c,
            gain_window=gain_w if plan.window_terms else None,
            gain_shadow=tuple(shadow_gains.items()),
            signal=share,
            system_throughput=ctl.tsys.get(cf_key(cf)),
            compression_throughput=ctl.tput().get(cf_key(cf)),
            wire_bytes=step_bytes,
            dense_wire_bytes=dense_bytes,
            compress_seconds=step.compress_seconds,
            comm_seconds=comm_seconds,
            skipped_steps=self.skipped_steps,
        )
        for f, g in zip(step.flights, totals, strict=True):
            f.result.set_result(g)
        return Outcome(False, tuple(totals), present, record, search=bool(compressed))

    def _keep_stats(self, step: Step, table: Tensor) -> None:
        """Reduce the step's lagging statistics over ranks (every rank's row of them), for the
        next step."""
        offset = 0
        for layers, local in step.stats:
            cols = table[:, offset : offset + local.numel()]
            offset += local.numel()
            op = self.compressor.stats_op
            self._lagged[layers] = cols.amax(dim=0) if op == "max" else cols.sum(dim=0)

    def _aggregate(self, f: _Flight, out: Tensor | None) -> Tensor:
        """The mean over ranks of what ``f`` sent, dense and flat, in ``out`` if given: the
        all-reduced tensor divided, or the compressor's combination of every rank's payload
        (once a step: it advances the compressor's shared state)."""
        arrived, c, n = f.arrived.value(), self.compressor, self.comm.world_size
        if f.pieces:
            total = out if out is not None else torch.empty_like(f.x.reshape(-1))
            for p, payloads in zip(f.pieces, arrived, strict=True):
                c.combine_mean(payloads, p.ctx, n, out=total[p.start : p.end])
            return total
        if f.sent is None:
            total = arrived if out is None or out is arrived else out.copy_(arrived)
            return total.div_(n) if n > 1 else total
        return c.combine_mean(arrived, f.sent[1], n, out=out).reshape(-1)

    def _lay(self, f: _Flight, target: Tensor | None, checked: Tensor | None) -> Tensor:
        """Lay ``f``'s aggregate into its place (``checked``: the aggregate, computed already);
        return a flat buffer the front end may reuse: ``target`` where the compressor wrote
        into the place itself, else the flat aggregate, copied into the place."""
        assert f.place is not None  # only called for a placed flight
        if checked is None and target is not None and f.sent is not None:
            payloads, (_, ctx), n = f.arrived.value(), f.sent, self.comm.world_size
            if self.compressor.combine_mean_placed(payloads, ctx, n, f.place):
                return target
        total = checked if checked is not None else self._aggregate(f, target)
        scatter_spans(*f.place, total)
        return total

    def _vouched(self, f: _Flight, bound: float) -> bool:
        """Whether ``f``'s aggregate is finite without a look at it: the compressor bounds
        every value aggregating it computes (:meth:`Compressor.mean_bound`), given the
        agreed ``bound`` on every rank's ``max |x|``, well inside the dtype's range."""
        if f.sent is None:
            return False
        limit = torch.finfo(f.x.dtype).max / _BOUND_MARGIN
        b = self.compressor.mean_bound(f.sent[1], self.comm.world_size, bound)
        return b is not None and b <= limit

    def _target(self, f: _Flight) -> Tensor | None:
        """Where ``f``'s vouched aggregate goes: ``f.out``; where ``f`` rotates, the old
        residual's storage, given up by the memory as ``x``'s becomes the residual (a new
        tensor, or the front end's spare, when there was none; dropped when the aggregate was
        checked elsewhere)."""
        if not f.rotate:
            return f.out
        assert f.residual is not None  # rotate: settled at launch
        old = self.memory.swap(f.unit.key, f.residual)
        if old is not None:
            return old
        return f.spare if f.spare is not None else torch.empty_like(f.residual.reshape(-1))

    def _update_residual(self, f: _Flight, present: tuple[bool, ...], plan: Plan) -> None:
        """``e <- x - D(sent)``, and what was sent (``x - e``) added to the window's sums
        (:meth:`_sums`)"""
        if not self._sums(plan):
            self._update_memory(f, present)
            return
        taken = f.taken if f.taken is not None else self.windows.taken(f.x, f.unit.numels)
        self._update_memory(f, present)
        residual = self.memory.residual(f.unit.key)
        self.windows.add(f.unit.layer_ids, f.unit.numels, taken, residual)

    def _replay(self, f: _Flight, plan: Plan) -> None:
        """Replay error feedback at each of ``plan.shadows`` on ``f``'s sampled gradient
        (:mod:`gravac.shadow`), added to the window's shadow sums as :meth:`_sums` says."""
        assert f.shadow is not None  # planned shadows: sampled at launch
        unit, select = f.unit, self.compressor.shadow_kept
        self.shadows.step(
            plan.shadows,
            unit.layer_ids,
            unit.numels,
            f.shadow,
            select,
            accumulate=self._sums(plan),
        )

    def _update_memory(self, f: _Flight, present: tuple[bool, ...]) -> None:
        """``e <- x - D(sent)``; what belongs to a tensor with a gradient on no rank stays in
        the residual (it is applied to nothing); after a dense send, ``e <- 0``."""
        if f.residual is not None:  # settled at launch, where every tensor had a gradient
            if not f.rotate:  # a rotating one was swapped in by _target()
                self.memory.keep(f.unit.key, f.residual)
            return
        absent = self._absent_mask(f, present)
        if f.dense and absent is None:
            self.memory.reset(f.unit.key)
            return
        if absent is None and f.sent is not None:
            self.memory.update_sent(f.unit.key, f.x, self.compressor, *f.sent)
            return
        applied = f.x if f.dense else self._decompressed(f)
        if absent is not None:
            applied = applied.masked_fill(absent, 0)
        self.memory.update(f.unit.key, f.x, applied)

    def _decompressed(self, f: _Flight) -> Tensor:
        """What ``f`` sent, dense (its pieces written side by side)."""
        if f.sent is not None:
            return self.compressor.decompress(*f.sent)
        dense = torch.empty_like(f.x.reshape(-1))
        for p in f.pieces:
            self.compressor.decompress_into(p.payload, p.ctx, dense[p.start : p.end])
        return dense

    @staticmethod
    def _absent_mask(f: _Flight, present: tuple[bool, ...]) -> Tensor | None:
        if not f.unit.slots or all(present[i] for i in f.unit.slots):
            return None
        return torch.cat(
            [
                torch.full((math.prod(s),), not present[i], dtype=torch.bool, device=f.x.device)
                for s, i in zip(f.unit.shapes, f.unit.slots, strict=True)
            ]
        )

    def finish(self, outcome: Outcome) -> None:
        """Count and log a committed step (after the wrapped optimizer stepped, for the
        optimizer front end), and run the controller's window rules."""
        record = outcome.record
        if outcome.skipped or record is None:
            return
        self.total_wire_bytes += record.wire_bytes
        self.total_dense_wire_bytes += record.dense_wire_bytes
        saved = self.total_dense_wire_bytes - self.total_wire_bytes
        record = dataclasses.replace(record, bytes_saved=saved)
        self.last_record = record
        self._alone += not self.comm.distributed
        if self.monitor is not None:
            self.monitor.log(record)
        self.last_cf = record.cf_sent if outcome.search else None
        if outcome.search:
            self.controller.end_step()
        self.steps += 1

    def _skip(self, step: Step) -> Outcome:
        """Skip the step on every rank: the compressor as before the step, residuals and
        controller untouched (never updated)."""
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient on at least one rank, or non-finite aggregate, at step "
                f"{step.index}"
            )
        self.compressor.load_state_dict(step.snapshot)
        self.controller.discard_step()
        for f in step.flights:  # what a skipped step aggregates: NaN (as the DDP hook gives)
            nan = f.out if f.out is not None else torch.empty_like(f.x.reshape(-1))
            f.result.set_result(nan.fill_(math.nan))
        self.skipped_steps += 1
        self._alone += not self.comm.distributed
        self.last_cf, self.last_comm = None, -1.0
        if self.skipped_steps & (self.skipped_steps - 1) == 0:  # 1, 2, 4, 8, ...: rate-limited
            warnings.warn(
                f"gravac skipped step {step.index}: a gradient or aggregate was not finite on "
                f"some rank ({self.skipped_steps} skipped so far; the next warning at "
                f"{2 * self.skipped_steps})",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.monitor is not None:
            phase = self.controller.phase.value
            self.monitor.log(StepRecord.skip(step.index, phase, self.skipped_steps))
        return _SKIP

    def forget(self, key: int) -> None:
        """Drop everything kept for unit ``key`` (its residual, the compressor's state and
        buffers), a unit that no longer exists (DDP's bucket rebuild)."""
        self.memory.reset(key)
        self.compressor.forget(key)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, *, with_memory: bool = True) -> dict[str, Any]:
        """Counters, residuals (unless ``with_memory`` is false: a front end that saves them
        its own way), controller and compressor state."""
        memory = {"memory": self.memory.state_dict()} if with_memory else {}
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "total_wire_bytes": self.total_wire_bytes,
            "total_dense_wire_bytes": self.total_dense_wire_bytes,
            "last_cf": self.last_cf,
            "lagged_stats": [(list(k), v.tolist()) for k, v in self._lagged.items()],
            "window_sums": self.windows.state_dict(),
            "shadow_sums": self.shadows.state_dict(),
            **memory,
            "compressor": self.compressor.state_dict(),
            "controller": self.controller.state_dict(),
            # What the state above is only valid with (checked by check_state).
            "controller_kind": type(self.controller).__name__,
            "compressor_config": repr(self.compressor),
            "world_size": self.comm.world_size,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Check a saved state before loading it: the same compressor (name and options), and
        a controller of the same kind (the searches by trial and by shadow take each other's:
        the shadow's is the trial's and its shadows); a different world size loads with a
        warning.

        Raises:
            ValueError: the state was saved with another compressor or controller.
        """
        saved = state.get("compressor_config")
        if saved is not None and saved != repr(self.compressor):
            raise ValueError(
                f"the checkpoint was saved with compressor {saved}, this one has "
                f"{self.compressor!r}: its compressor state and residuals do not apply"
            )
        kind = type(self.controller).__name__
        saved_kind = state.get("controller_kind")
        old = saved_kind is None and kind in _WINDOW_SEARCHES
        if old and "current" not in state.get("controller", {}):
            saved_kind = "another controller"  # saved before the kind was: no window search
        if (
            saved_kind is not None
            and saved_kind != kind
            and not ({saved_kind, kind} <= _WINDOW_SEARCHES)
        ):
            raise ValueError(
                f"the checkpoint was saved by {saved_kind}, this optimizer runs {kind} "
                f"({self.controller.policy!r}): its search state does not apply; build the "
                "optimizer with the policy and policy options it was saved with"
            )
        world = state.get("world_size")
        if world is not None and world != self.comm.world_size:
            warnings.warn(
                f"loading a checkpoint saved with world size {world} into world size "
                f"{self.comm.world_size}: each rank's residuals are its own, so they now stand "
                "for other ranks' unsent gradients (a one-off perturbation)",
                stacklevel=4,
            )

    def load_state_dict(self, state: dict[str, Any], *, with_memory: bool = True) -> None:
        """Restore what :meth:`state_dict` returned (the caller validates and rolls back)."""
        self.controller.load_state_dict(state["controller"])
        self.compressor.load_state_dict(state["compressor"])
        if with_memory:
            self.memory.load_state_dict(state["memory"])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.total_wire_bytes = int(state["total_wire_bytes"])
        self.total_dense_wire_bytes = int(state["total_dense_wire_bytes"])
        self.last_cf = state["last_cf"]
        self.last_close, self.last_comm = None, -1.0
        lagged = state.get("lagged_stats", [])
        self._lagged = {tuple(k): torch.tensor(v, dtype=torch.float64) for k, v in lagged}
        self.windows.load_state_dict(state.get("window_sums", {"sent": []}))
        self.shadows.load_state_dict(state.get("shadow_sums", {}))


#: the controllers whose checkpoints load into each other (:meth:`Engine.check_state`)
_WINDOW_SEARCHES = {"TrialController", "ShadowController"}


def _aliases(payload: Payload, x: Tensor) -> bool:
    """Whether a tensor of ``payload`` shares ``x``'s storage (``none`` sends ``x`` itself),
    so that updating the residual in ``x`` before the send would change what is sent."""
    ptr = x.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in payload_tensors(payload))


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _achieved_cf(flights: Sequence[_Flight]) -> float:
    """The CF achieved over the compressed units: elements over float32 elements sent."""
    numel = sum(f.unit.numel for f in flights)
    sent = sum(f.sent_elements for f in flights)
    return numel / sent if sent > 0 else 1.0


def _runs(shapes: Sequence[torch.Size], cfs: Sequence[float]) -> list[tuple[int, int, int, int]]:
    """The runs of adjacent tensors at one CF: ``(first, last)`` tensor indices (``last``
    excluded) and the ``(start, end)`` elements they span."""
    runs: list[tuple[int, int, int, int]] = []
    offset = 0
    for i, (shape, cf) in enumerate(zip(shapes, cfs, strict=True)):
        end = offset + math.prod(shape)
        if runs and cfs[runs[-1][0]] == cf:
            first, _, start, _ = runs[-1]
            runs[-1] = (first, i + 1, start, end)
        else:
            runs.append((i, i + 1, offset, end))
        offset = end
    return runs
