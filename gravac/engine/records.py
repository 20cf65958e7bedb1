"""The records a step is made of: units, how a front end hands a unit's buffer over, what is in
flight, the step, and its outcome."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from gravac.comm import Arrival
from gravac.compressors.base import Compressor, Context, Payload
from gravac.control.records import Decision, Plan
from gravac.control.replay import Replayed
from gravac.control.window import SampledSend
from gravac.engine.scalars import terms_size
from gravac.monitor import StepRecord
from gravac.spans import Place

__all__ = [
    "PIECE_KEY_BASE",
    "PIECE_KEY_STRIDE",
    "Flight",
    "Given",
    "Handover",
    "Lent",
    "Outcome",
    "Piece",
    "Step",
    "Unit",
    "piece_key",
]

#: keys of the pieces of a unit sent at per-layer CFs (:meth:`Engine._launch_layers`), apart
#: from every unit's key (compressors seed and keep state per key): base + key * stride + the
#: index of the piece's first tensor (and the default layer ids of :attr:`Unit.layers`)
PIECE_KEY_BASE = 1 << 40
PIECE_KEY_STRIDE = 1 << 20


def piece_key(key: int, index: int) -> int:
    """The key of unit ``key``'s piece that starts at its tensor ``index`` (and the default
    layer id of that tensor): ``PIECE_KEY_BASE + key * PIECE_KEY_STRIDE + index``."""
    return PIECE_KEY_BASE + key * PIECE_KEY_STRIDE + index


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
        return self.layers or tuple(piece_key(self.key, i) for i in range(len(self.shapes)))

    @property
    def numel(self) -> int:
        """Elements in the unit."""
        return sum(self.numels)

    @property
    def numels(self) -> tuple[int, ...]:
        """Elements in each of its tensors."""
        return tuple(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Lent:
    """The front end lends a unit's flat gradient: the engine reads it and never writes it,
    unless it is ``out`` itself.

    Attributes:
        out: a flat tensor of the unit's size and the gradient's dtype that receives the
            aggregate at commit (the DDP hook passes its bucket's own buffer, the gradient
            itself: no gradient-sized temporary); ``None``: a new tensor.
    """

    out: Tensor | None = None


@dataclass(frozen=True)
class Given:
    """The front end gives a unit's flat gradient to the engine until commit.

    A compressed unit's error-fed gradient ``x = g + e`` is formed in it
    (:meth:`gravac.memory.Memory.compensate_`); where a compressed payload is sent and the
    residual settled before the send, it becomes the residual and the aggregate is written into
    the old residual's storage. The front end then keeps the future's tensor as its gradient
    buffer: the unit holds two gradient-sized buffers (the given one and the residual), not
    three (one for ``x``).

    Attributes:
        packed: the buffer already holds the gradient plus what :meth:`Engine.addend`
            returned for it (which then was a tensor): it is ``x``, compensated as it was
            written.
        spare: a flat tensor of the unit's size and dtype for the aggregate where the unit has
            no residual yet whose storage it would take (the first step): a front end that
            keeps several units' aggregates side by side (the pieces of a split tensor) passes
            slices of one buffer. ``None``: a new tensor.
        place: ``(buffer, spans)``: lay the aggregate into ``buffer``'s ``spans`` at commit
            (:mod:`gravac.spans`; a DDP bucket that mixes this unit's tensors with others),
            written there by the compressor where it can
            (:meth:`Compressor.combine_mean_placed`), not copied from a flat aggregate. The
            future then completes with a flat tensor of the unit's size that the engine no
            longer needs, the front end's to reuse (the next buffer it gives).
    """

    packed: bool = False
    spare: Tensor | None = None
    place: Place | None = None


#: how a front end hands a unit's gradient to :meth:`Engine.launch`
Handover = Lent | Given


@dataclass(frozen=True)
class Piece:
    """Elements ``start:end`` of a unit, compressed and sent on their own (per-layer CFs)."""

    start: int
    end: int
    payload: Payload
    ctx: Context
    arrived: Arrival[Any]  # every rank's payload
    by: Compressor  # what compressed it: the engine's, or NoneCompressor where sent dense


@dataclass
class Flight:
    """One launched unit: what it compressed, what it sent, and the aggregate to come."""

    unit: Unit
    x: Tensor  # the error-fed gradient (the gradient itself for a dense unit)
    sent: tuple[Payload, Context] | None  # the payload sent; None: x dense, or pieces
    arrived: Arrival[Any]  # the collective: the all-reduced x, or every rank's payload(s)
    wire_bytes: int
    out: Tensor | None  # where the aggregate is written (None: a new tensor)
    result: Future[Tensor] = field(default_factory=Future)  # the aggregate, set at commit
    pieces: tuple[Piece, ...] = ()  # per-layer CFs: what each piece sent
    # the new residual, settled at launch in x's storage (Memory.settle; None: made at commit)
    residual: Tensor | None = None
    taken: Tensor | None = None  # the window's sample of x, taken before settling
    # what x sent, sampled for the window, once the residual was settled at launch (held in
    # place of taken: a sparsifier's is mostly zero, and kept compact)
    window_send: SampledSend | None = None
    shadow: Tensor | None = None  # the sampled gradient, for the plan's shadow CFs
    replayed: Replayed | None = None  # the shadow CFs replayed on it, applied at commit
    # x is in the front end's buffer and becomes the residual: the aggregate goes into the old
    # residual's storage at commit (out, still x's, receives a skipped step's NaN)
    rotate: bool = False
    # where a rotating aggregate goes when there is no old residual yet (None: a new tensor)
    spare: Tensor | None = None
    # the buffer and spans the aggregate is laid into (Given.place); None: flat
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
        terms: the local gain terms, summed over the compressed units (float64,
            :class:`gravac.engine.scalars.Terms`).
        compress_seconds: time spent compensating, compressing and computing gain terms.
        closed_at: the clock at the end of :meth:`Engine.close` (its collectives started, its
            shadows replayed); ``None`` before.
        scalars: every rank's scalars (set by :meth:`Engine.close`).
        flags: how many has-gradient flags this step's scalars carry (set by :meth:`Engine.close`).
        values: how many controller values they carry (set by :meth:`Engine.close`).
        stats: each unit's (or piece's) layers and local compressor statistics, to agree with
            the scalars for the next step (compressors whose statistics may lag).
        totals: each compressed tensor's sampled window sum ``X`` (a plan with ``signal``, at
            the step that closes a window), as much of it as is summed over ranks at
            :meth:`Engine.close` (:func:`gravac.control.noise.signal_sample`).
        signal: that sum (set by :meth:`Engine.close`).
        scattering: in two levels, the units whose node sums are being reduce-scattered
            (:meth:`Engine.scatter`), in launch order: each one's chunk, its node sum, and that
            of the residual pieces carried into it (``None``: none), until launched.
        wholes: in two levels, the elements of every unit scattered this step, in launch
            order (:meth:`Engine.commit` gathers each one's chunks back into one aggregate).
        lr: the wrapped optimizer's learning rate at the step (``None``: unknown).
    """

    index: int
    plan: Plan
    decision: Decision
    snapshot: dict[str, Any]
    flights: list[Flight] = field(default_factory=list)
    ends: list[Tensor] = field(default_factory=list)
    bounds: list[Tensor] = field(default_factory=list)
    terms: Tensor = field(default_factory=lambda: torch.zeros(terms_size(0), dtype=torch.float64))
    compress_seconds: float = 0.0
    closed_at: float | None = None
    scalars: Arrival[list[Tensor]] | None = None
    flags: int = 0
    values: int = 0
    stats: list[tuple[tuple[int, ...], Tensor]] = field(default_factory=list)
    totals: list[Tensor] = field(default_factory=list)
    signal: Arrival[Tensor] | None = None
    scattering: list[tuple[Unit, Arrival[Tensor], Arrival[Tensor] | None]] = field(
        default_factory=list
    )
    wholes: list[int] = field(default_factory=list)
    lr: float | None = None


@dataclass(frozen=True)
class Outcome:
    """A committed step: each unit's aggregate, or a skip.

    Attributes:
        skipped: the step is skipped (non-finite values), or dropped, on every rank; nothing
            else is set.
        grads: each unit's aggregate divided by the world size, in launch order (for a unit
            launched with a :attr:`Given.place`: a flat buffer for the front end to reuse, the
            aggregate being laid into the place).
        present: for each has-gradient flag, whether some rank had that gradient.
        record: what the step did (logged by :meth:`Engine.finish`).
        search: whether the step took part in the controller's search (something compressed).
    """

    skipped: bool
    grads: tuple[Tensor, ...] = ()
    present: tuple[bool, ...] = ()
    record: StepRecord | None = None
    search: bool = False
