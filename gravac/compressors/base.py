"""The compressor interface shared by every gradient compressor.

A compressor maps a requested compression factor (CF, docs/design.md section 1) to its own knob (k
kept elements, bits, rank), compresses a tensor into a named *payload* (the tensors that travel)
and a local *context* (what the sender keeps), and decompresses back to a dense tensor of the
input's shape and dtype. Error feedback is not part of a compressor: see :mod:`gravac.memory`.

Aggregation follows the compressor's collective:

* ``"allreduce"``: payload tensors are summed elementwise across ranks, then decompressed once
  (the compressors whose decompression is linear in the payload: none, fp16, Random-k, ...);
* ``"allgather"``: every rank's payload is gathered and the decompressed payloads are summed
  (Top-k, DGC, RedSync), with payloads of exact, CF-determined size so no size exchange is needed.

Compressors that need values agreed by all ranks before compressing (THC's max-norm, TopKC's
chunk norms) are :class:`Agreeing`: they return them from :meth:`Agreeing.local_stats`; the caller
reduces them across ranks by :attr:`Agreeing.stats_rule` and passes the result as
:attr:`Round.agreed`.

Edge cases, the same for every compressor (tested over the registry):

* an empty tensor compresses to an empty payload (0 wire bytes, achieved CF 1) and decompresses
  to an empty tensor of its shape; its gain is 1;
* 0-d and one-element tensors are compressed as one element (a sparsifier keeps it: CF 1);
* non-finite values propagate: sparsifiers rank NaN and +-Inf above every finite magnitude, so
  they are sent rather than hidden in a residual, and the gain of a non-finite input is NaN,
  which :class:`gravac.GravacOptimizer` turns into a skipped step on every rank;
* any floating dtype is accepted and decompression returns the input's dtype; payload values
  keep the input dtype unless the compressor defines its wire format (casts, THC, PowerSGD).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from gravac.checks import check_cf
from gravac.gain import gain_terms
from gravac.memory import Memory, ResidualMemory
from gravac.spans import Place

__all__ = [
    "Agreeing",
    "Collective",
    "Compressor",
    "Context",
    "Multilevel",
    "Payload",
    "Replayable",
    "Round",
    "StatsOp",
    "StatsRule",
    "agreed_stats",
    "check_cf",
    "k_for_cf",
    "local_stats",
    "payload_tensors",
    "stats_rule",
    "sum_payloads",
    "wire_bytes",
]

Collective = Literal["allreduce", "allgather"]
StatsOp = Literal["sum", "max"]

#: Bits of the float32 reference element every CF is counted against (docs/design.md section 1).
REFERENCE_BITS = 32


@dataclass(frozen=True)
class Round:
    """Facts about one compression call that every rank shares.

    Attributes:
        step: global optimizer step; seeds shared randomness (Random-k indices, THC diagonals).
        key: which bucket or tensor this is; keys per-tensor state and seeds.
        world_size: number of ranks whose payloads will be aggregated.
        agreed: the result of reducing every rank's :meth:`Agreeing.local_stats` by
            :attr:`Agreeing.stats_rule`; ``None`` for compressors that need none.
        layout: shapes of the tensors packed, in order, into a flat bucket ``x`` (their numels
            add up to ``x.numel()``); ``None`` when ``x`` is a single tensor of its own shape.
            Compressors that work per matrix (PowerSGD) read it.
        stale: ``agreed`` holds the previous step's statistics, not this step's (only for a
            compressor whose :attr:`StatsRule.may_lag`).
        ranks: per tensor of the layout, the rank it is sent at in place of the CF's (a
            compressor that :attr:`Compressor.takes_ranks`: Accordion's per-layer ranks);
            ``None``: the CF decides.
    """

    step: int = 0
    key: int = 0
    world_size: int = 1
    agreed: Tensor | None = None
    layout: tuple[torch.Size, ...] | None = None
    stale: bool = False
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"Round.step must be >= 0, got {self.step}")
        if self.world_size < 1:
            raise ValueError(f"Round.world_size must be >= 1, got {self.world_size}")
        if self.ranks is not None and any(r < 1 for r in self.ranks):
            raise ValueError(f"Round.ranks must be integers >= 1, got {self.ranks}")


@dataclass(frozen=True)
class Payload:
    """Base of every payload: a frozen record whose tensor fields are what travels on the wire."""


@dataclass(frozen=True)
class Context:
    """What the sender keeps locally to decompress and to report.

    Attributes:
        shape: shape of the compressed input.
        dtype: dtype of the compressed input (decompression returns it).
        numel: number of elements of the input.
        achieved_cf: the CF really achieved (docs/design.md section 1), >= 1.
    """

    shape: torch.Size
    dtype: torch.dtype
    numel: int
    achieved_cf: float


def payload_tensors(payload: Payload) -> list[Tensor]:
    """The tensors of a payload, in field order (the order they travel in)."""
    return [getattr(payload, f.name) for f in dataclasses.fields(payload)]


def wire_bytes(payload: Payload) -> int:
    """Bytes the payload puts on the wire: the sum of its tensors' sizes."""
    return sum(t.numel() * t.element_size() for t in payload_tensors(payload))


def k_for_cf(numel: int, cf: float) -> int:
    """Elements a sparsifier keeps for CF ``cf``: ``k = clamp(round(d / cf), 1, d)``.

    An empty tensor keeps 0. At least one element is kept so that every rank sends a payload of
    the same, non-zero size and the all-gather never sees an empty tensor.
    """
    if numel == 0:
        return 0
    return max(1, min(numel, round(numel / check_cf(cf))))


class Compressor(ABC):
    """Base class of all compressors.

    Subclasses set the class attributes and implement :meth:`compress` and :meth:`decompress`.
    What only some compressors can do is a protocol of its own, which they implement:
    :class:`Agreeing` (values agreed over ranks before compressing), :class:`Multilevel`
    (compress their own payload further) and :class:`Replayable` (what they keep can be
    replayed on a sample of the gradient).
    """

    #: registry name
    name: ClassVar[str]
    #: the collective that aggregates payloads (an instance may choose, e.g. THC's transport)
    collective: Collective
    #: whether the payload is the input itself, summed as it is: the aggregate is then
    #: non-finite on every rank wherever an input is on one, and the engine checks only it
    sends_input: ClassVar[bool] = False
    #: a smaller bucket than DDP's 25 MiB that :class:`gravac.GravacOptimizer` packs for this
    #: compressor when its caller does not choose (``bucket_bytes=None``), raised for a large
    #: model (:func:`gravac.buckets.default_bucket_bytes`); ``None``: DDP's 25 MiB
    bucket_bytes: ClassVar[int | None] = None
    #: whether a tensor planned at CF 1 (:meth:`deliverable_cf` snaps CFs at or below the
    #: compressor's break-even to 1) is sent as it is, through the all-reduce, with no
    #: residual: a sparsifier's payload at CF 1 would be every value and its index, twice the
    #: dense bytes through an all-gather
    dense_at_one: ClassVar[bool] = False
    #: whether it sends a tensor at a rank given in :attr:`Round.ranks` (a low-rank compressor:
    #: a rank is one knob across shapes, where one CF is a different rank per shape)
    takes_ranks: ClassVar[bool] = False

    def deliverable_cf(self, cf: float, world_size: int = 1) -> float:
        """The CF this compressor actually delivers, in wire bits, when asked for ``cf``.

        The controller plans, records and logs only such CFs (a CF it cannot deliver would key
        its tables by a fiction). Sparsifiers keep ``round(d / cf)`` elements, which is ``cf``
        up to rounding: the default returns ``cf``.
        """
        return check_cf(cf)

    def bind_shapes(self, shapes: Sequence[torch.Size]) -> None:
        """The shapes of every tensor this compressor will compress (the engine calls it when
        the layout is known or changes), for compressors whose deliverable CFs depend on them
        (PowerSGD's integer ranks). The default ignores them."""
        return None

    def forget(self, key: int) -> None:
        """Drop what this compressor keeps for unit ``key`` (state, buffers): the engine calls
        it when the unit is retired (DDP's bucket rebuild). The default keeps nothing per key."""
        return None

    @abstractmethod
    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[Payload, Context]:
        """Compress ``x`` at CF ``cf``; returns the payload that travels and the local context."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        """Dense tensor of ``ctx.shape`` and ``ctx.dtype`` that the payload represents."""

    def sent_terms(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """``[<c, x>, ||c||^2]`` in float64 for ``c = D(payload)`` sent for ``x``: the terms of
        the compression gain (:mod:`gravac.gain`) that depend on what is sent.

        The default decompresses to a dense tensor; compressors that can read the terms off
        the payload override it (a sparsifier sends values of ``x`` itself, so both terms are
        the sum of the squared values sent).
        """
        return gain_terms(x, self.decompress(payload, ctx))[:2]

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """``x - D(payload)``, the error-feedback residual of sending ``payload`` for ``x``,
        computed in ``x``'s storage (``x`` is consumed). Sparsifiers override it with zeroing
        the sent positions (no dense decompression)."""
        return x.sub_(self.decompress(payload, ctx))

    def combine(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None = None
    ) -> Tensor:
        """Sum over ranks of the decompressed payloads, as the collective computes it.

        For ``allreduce`` compressors the payload tensors are summed and decompressed once; a
        single already all-reduced payload is simply decompressed. ``allgather`` compressors
        decompress each payload and sum (subclasses override with a fused scatter-add).

        Args:
            out: a flat tensor of ``ctx.numel`` elements of ``ctx.dtype``, overlapping no
                payload, that receives the sum (the result is then a view of it); ``None``: a
                new tensor.
        """
        if not payloads:
            raise ValueError("combine() needs at least one payload, got none")
        if self.collective == "allreduce":
            return self.decompress_into(sum_payloads(payloads), ctx, out)
        total = self.decompress(payloads[0], ctx)
        for p in payloads[1:]:
            total = total + self.decompress(p, ctx)
        return total if out is None else out.copy_(total.reshape(-1)).view(ctx.shape)

    def combine_mean(
        self,
        payloads: Sequence[Payload],
        ctx: Context,
        world_size: int,
        out: Tensor | None = None,
    ) -> Tensor:
        """:meth:`combine` divided by ``world_size``: the mean over ranks that the optimizer
        applies. The default divides the sum (a pass over it); compressors that can fold the
        division into work they do anyway override it (a sparsifier divides the gathered
        values, a 16-bit cast its scale)."""
        total = self.combine(payloads, ctx, out)
        return total.div_(world_size) if world_size > 1 else total

    def combine_mean_placed(
        self, payloads: Sequence[Payload], ctx: Context, world_size: int, place: Place
    ) -> bool:
        """:meth:`combine_mean` laid into a place (:mod:`gravac.spans`): the unit's flat
        elements, span by span, into a buffer that holds other tensors between them (a DDP
        bucket), written there by a compressor that makes its result element by element (a
        sparsifier at moved positions, a cast span by span), with no copy of the aggregate.

        Returns whether it did. The default does not: the caller combines into a flat tensor
        and copies that into the spans (:func:`gravac.spans.scatter_spans`).
        """
        return False

    def mean_bound(self, ctx: Context, world_size: int, x_bound: float) -> float | None:
        """A bound on the magnitude of every value that aggregating ``world_size`` payloads
        compressed with context ``ctx`` computes (the collective's sums, :meth:`combine_mean`
        and its result), when every rank's input ``x`` has ``max |x| <= x_bound``; ``None``
        (the default): no bound is known.

        Where the bound is finite with room to spare, the aggregate is finite without a pass
        over it, and the engine can write it where a skipped step could not be undone (a
        residual's storage).
        """
        return None

    def decompress_into(self, payload: Payload, ctx: Context, out: Tensor | None) -> Tensor:
        """:meth:`decompress` written into ``out`` (as in :meth:`combine`) when given. The
        default copies; compressors that build the dense tensor themselves override it."""
        dense = self.decompress(payload, ctx)
        if out is None:
            return dense
        if dense.data_ptr() != out.data_ptr():  # a payload summed in place in out: no copy
            out.copy_(dense.reshape(-1))
        return out.view(ctx.shape)

    def make_memory(self) -> Memory:
        """A fresh error-feedback memory for this compressor (plain residuals by default)."""
        return ResidualMemory()

    def state_dict(self) -> dict[str, Any]:
        """Per-tensor state to checkpoint (warm starts, PRNG counters); empty by default."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"compressor {self.name!r} keeps no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def sum_payloads(payloads: Sequence[Payload]) -> Payload:
    """Elementwise sum of payloads of one type (what an all-reduce computes); a single
    payload is its own sum (returned as it is, not copied)."""
    first = payloads[0]
    if len(payloads) == 1:
        return first
    summed = {}
    for f in dataclasses.fields(first):
        total = getattr(first, f.name).clone()
        for p in payloads[1:]:
            total.add_(getattr(p, f.name))
        summed[f.name] = total
    return dataclasses.replace(first, **summed)


@dataclass(frozen=True)
class StatsRule:
    """How an :class:`Agreeing` compressor's statistics are agreed over ranks.

    Attributes:
        op: how every rank's :meth:`Agreeing.local_stats` are reduced: ``"sum"`` or ``"max"``.
        may_lag: :meth:`Compressor.compress` stays exact under error feedback with the previous
            step's statistics (:attr:`Round.stale`): the engine then agrees them beside the
            step's other scalars instead of in a blocking collective before compressing.
        shows_nonfinite: the statistics are non-finite exactly when ``x`` holds a non-finite
            value: the engine then takes them as the non-finite check, without a pass of its own.
        degree: those of ``c * x`` are ``c ** degree`` times those of ``x`` for ``c > 0`` (1: a
            magnitude or a norm; 2: a squared norm): lagging ones follow a change of the
            gradients' unit (:meth:`gravac.engine.Engine.rescale`).
    """

    op: StatsOp = "sum"
    may_lag: bool = False
    shows_nonfinite: bool = False
    degree: int = 1


@runtime_checkable
class Agreeing(Protocol):
    """A compressor that needs values agreed over ranks before it compresses (THC's and the
    casts' scales, chunked Top-k's chunk norms): each rank computes :meth:`local_stats`, the
    engine reduces them by :attr:`stats_rule` and passes the result as :attr:`Round.agreed`."""

    #: how the statistics are reduced, and what the engine may do with them
    stats_rule: ClassVar[StatsRule]

    def local_stats(self, x: Tensor, cf: float, rnd: Round) -> Tensor | None:
        """Values all ranks must agree on before compressing ``x`` (``None``: nothing, an
        empty ``x``)."""
        ...


def stats_rule(c: Compressor) -> StatsRule | None:
    """``c``'s :class:`StatsRule`; ``None`` for a compressor that agrees nothing."""
    return c.stats_rule if isinstance(c, Agreeing) else None


def local_stats(c: Compressor, x: Tensor, cf: float, rnd: Round) -> Tensor | None:
    """``c``'s statistics of ``x`` to agree over ranks; ``None`` for a compressor that agrees
    nothing (not :class:`Agreeing`)."""
    return c.local_stats(x, cf, rnd) if isinstance(c, Agreeing) else None


def agreed_stats(c: Agreeing, x: Tensor, cf: float, rnd: Round) -> Tensor | None:
    """``rnd.agreed``; with one rank and nothing agreed, this rank's
    :meth:`Agreeing.local_stats`; ``None`` where :meth:`Agreeing.local_stats` has nothing to
    agree (an empty ``x``: the engine agrees nothing then, as every rank's ``x`` has the same
    shape).

    Raises:
        ValueError: ``rnd.agreed`` is missing with more than one rank, for an ``x`` that has
            statistics to agree.
    """
    if rnd.agreed is not None:
        return rnd.agreed
    if x.numel() == 0 and c.local_stats(x, cf, rnd) is None:
        return None
    if rnd.world_size != 1:
        name = getattr(c, "name", type(c).__name__)
        raise ValueError(
            f"{name} needs rnd.agreed: the {c.stats_rule.op} over ranks of local_stats() "
            f"(world_size={rnd.world_size})"
        )
    return c.local_stats(x, cf, rnd)


@runtime_checkable
class Multilevel(Protocol):
    """A compressor that compresses its own compressed result further (multi-level
    compression, docs/design.md section 7): for a sparsifier, compressing the theta_1 result to
    theta_2 equals compressing the input at theta_2 directly, at a fraction of the cost. The
    engine compresses a step's candidate CF this way where it can, else from the input."""

    def recompress(
        self, payload: Payload, ctx: Context, cf: float, rnd: Round
    ) -> tuple[Payload, Context]:
        """Compress an already compressed result further, to the overall CF ``cf``."""
        ...


@runtime_checkable
class Replayable(Protocol):
    """A compressor whose sends at a CF can be replayed on a sample of the gradient, for the
    search by shadow's window gains of CFs it does not send (:mod:`gravac.control.replay`)."""

    def shadow_kept(self, values: Tensor, cf: float) -> Tensor:
        """int64 positions of the entries of 1-D ``values`` (a sample of an error-fed
        gradient) that this compressor keeps at ``cf``."""
        ...
