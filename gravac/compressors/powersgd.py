"""PowerSGD: low-rank gradient compression by warm-started power iteration, one all-reduce a step.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (docs/design.md sections 1 and 10). Each tensor of a bucket with two or
more dimensions is viewed as a matrix ``M`` of shape ``(shape[0], -1) = (m, n)`` and approximated at
rank ``r``, chosen from the requested CF by the rule of docs/design.md section 1::

    CF = m n / (r (m + n))   =>   r = clamp(floor(m n / (CF (m + n))), 1, min(m, n))

Like the authors' reference code (epfml/powersgd), a step sends *one* factor and the steps
alternate between the two sides of the matrix, so that one all-reduce suffices. The ranks share
an orthonormal basis from the previous step (initially random, seeded identically everywhere):

* a *left* step, with the shared right basis ``Q`` (n x r), sends ``P = M Q`` and reconstructs
  ``P Q^T``; the aggregate ``sum_i P_i`` is orthonormalised into the next shared *left* basis;
* a *right* step, with the shared left basis ``P^`` (m x r), sends ``Q = M^T P^`` and
  reconstructs ``P^ Q^T``; ``sum_i Q_i`` is orthonormalised into the next right basis.

Both reconstructions are linear in the factor sent, so decompressing the all-reduced sum gives the
sum of the ranks' approximations, and each is an orthogonal projection of ``M`` (of its rows onto
``span Q``, of its columns onto ``span P^``). Two consecutive steps make one power iteration; with
warm start (the reuse of the basis) the bases track the gradient's leading singular subspaces.

Integer ranks deliver only some CFs, and which ones depends on every matrix's shape: once the
engine binds the layout (:meth:`PowerSGDCompressor.bind_shapes`), :class:`RankTable` snaps a
requested CF to the nearest one the layout delivers, and compressing at it uses the ranks that
deliver it exactly.

Tensors with fewer than two dimensions, fewer than ``min_numel`` elements, or whose rate
``m n / (r (m + n))`` at the chosen rank is below ``min_compression_rate`` travel dense, exactly.
The achieved CF is the bucket's element count over the elements this step's payload holds (one
factor per matrix plus the dense values).

.. note::
   The state update (orthonormalising the aggregated factor, flipping the side) happens in
   :meth:`PowerSGDCompressor.combine`, which every rank calls once per round with the same
   aggregate; :meth:`~PowerSGDCompressor.compress` and :meth:`~PowerSGDCompressor.decompress` are
   pure, so a step may compress at several CFs and only the payload that travels moves the state.
   When the rank changes, the stored basis is cut to its leading columns or extended by seeded
   random columns and re-orthonormalised; a new layout for a bucket key resets its state.

.. note::
   Because each step sends one factor, the per-step CF is ``n / r`` (left) or ``m / r`` (right),
   about twice the CF of the rank rule for square matrices: the rank rule counts a whole power
   iteration, ``r (m + n)`` elements, which the alternation spreads over two steps.

.. note::
   Factors are computed and sent in float32 (float64 for float64 gradients) whatever the
   gradient's dtype: orthonormalisation in 16 bits loses the basis. ``achieved_cf`` counts
   elements (docs/design.md section 1); ``wire_bytes`` counts the real bytes. With
   ``warm_start=False`` each step draws a fresh seeded basis and sends ``P = M Q`` for it: with
   one all-reduce a step that is a random rank-r projection, not a power iteration.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import torch
from torch import Tensor

from gravac.compressors.base import (
    Collective,
    Compressor,
    Context,
    Payload,
    Round,
    check_cf,
    sum_payloads,
)
from gravac.compressors.registry import register
from gravac.gain import squared_norm
from gravac.kernels.buffers import BufferPool
from gravac.kernels.subnormal import flush_subnormal_
from gravac.seeding import generator

__all__ = [
    "DEFAULT_MIN_COMPRESSION_RATE",
    "DEFAULT_MIN_NUMEL",
    "LEFT",
    "RIGHT",
    "PowerSGDCompressor",
    "PowerSGDContext",
    "PowerSGDPayload",
    "RankTable",
    "TensorPlan",
    "compression_rate",
    "fit_basis",
    "orthonormalize",
    "rank_for_cf",
]

#: Compress a matrix only if it shrinks at least this much, m n / (r (m + n)) >= rate: below it
#: the two matrix products and the orthonormalisation cost more than the bytes they save. The
#: default of PyTorch's PowerSGD hook and of epfml/powersgd.
DEFAULT_MIN_COMPRESSION_RATE = 2.0
#: Tensors with fewer elements go dense: 256 float32 values are 1 KiB, less than the per-tensor
#: overhead (two small matmuls and a QR) is worth; the front ends pack small matrices into
#: compressed buckets (docs/design.md section 3), so this sends them dense within the payload.
DEFAULT_MIN_NUMEL = 256
#: Seed of the shared random bases when none is given (every rank must use the same).
DEFAULT_SEED = 0
#: Sides: which factor a step sends. LEFT sends P = M Q (basis: n x r); RIGHT sends Q = M^T P^.
LEFT = 0
RIGHT = 1
#: Domain separator in the seed of the random basis columns, so they never share a stream with
#: another user of :func:`gravac.seeding.derive_seed` seeded by the same (seed, key, step).
_BASIS_STREAM = 0x50535344  # "PSSD"


def rank_for_cf(m: int, n: int, cf: float) -> int:
    """Rank of an ``m x n`` matrix at CF ``cf``: ``clamp(floor(mn / (cf (m + n))), 1, min(m, n))``.

    The inverse of ``CF = mn / (r (m + n))`` (docs/design.md section 1), rounded down so the CF is
    at least met.
    """
    return max(1, min(m, n, math.floor(m * n / (check_cf(cf) * (m + n)))))


def compression_rate(m: int, n: int, rank: int) -> float:
    """Rate of sending both rank-``rank`` factors of an ``m x n`` matrix: ``mn / (r (m + n))``."""
    return m * n / (rank * (m + n))


class RankTable:
    """The CFs a layout of tensors can be sent at, and the rank-rule CF that delivers each.

    The rank rule rounds each matrix alone, so the CF a whole layout achieves at the ranks
    chosen for ``cf`` is not ``cf``, and asking for that achieved CF can choose other ranks.
    The rule's ranks are constant between consecutive breakpoints ``mn / (r (m + n))``; each such
    piece delivers one CF, ``sum(numel) / sum(sent)`` with ``r (m + n)`` sent for a matrix and
    ``numel`` for a dense tensor. A requested CF maps to the piece whose delivered CF is nearest
    (in ratio), and that piece's ranks are the rule's at a CF inside it (its ``knob``), so that
    asking for a delivered CF delivers it.

    Args:
        shapes: every compressed tensor's shape.
        ranks: the compressor's rule, ``rank_for(shape, cf)`` vectorised over an array of CFs
            (0 for dense), as an array of ranks.
    """

    def __init__(
        self, shapes: Sequence[torch.Size], ranks: Callable[[torch.Size, np.ndarray], np.ndarray]
    ) -> None:
        counts = Counter(torch.Size(shape) for shape in shapes)
        breaks = {1.0}  # CFs below 1 are never asked for
        for shape in counts:
            if len(shape) >= 2 and shape.numel():
                m, n = _matrix_view(shape)
                cuts = m * n / (np.arange(1, min(m, n) + 1, dtype=np.float64) * (m + n))
                breaks.update(cuts[cuts > 1.0].tolist())
        edges = np.array(sorted(breaks))
        # one CF strictly inside each piece: midpoints, and one past the last breakpoint
        knobs = np.append((edges[:-1] + edges[1:]) / 2, edges[-1] * 2)
        total = sum(shape.numel() * k for shape, k in counts.items())
        sent = np.zeros_like(knobs)
        for shape, k in counts.items():
            rank = ranks(shape, knobs)
            sent += k * np.where(rank == 0, shape.numel(), rank * sum(_matrix_view(shape)))
        delivered = np.where(sent > 0, total / np.maximum(sent, 1), knobs)
        # pieces whose ranks changed only among dense choices deliver the same CF: keep one
        _, first = np.unique(delivered, return_index=True)
        order = np.sort(first)
        self.delivered = delivered[order]  # increasing: ranks fall as the CF rises
        self.knobs = knobs[order]

    def _piece(self, cf: float) -> int:
        i = int(np.searchsorted(self.delivered, cf))
        if i == 0:
            return 0
        if i == len(self.delivered):
            return i - 1
        lo, hi = self.delivered[i - 1], self.delivered[i]
        return i - 1 if cf / lo <= hi / cf else i

    def snap(self, cf: float) -> float:
        """The delivered CF nearest ``cf`` (by ratio)."""
        return float(self.delivered[self._piece(cf)])

    def knob(self, cf: float) -> float:
        """The CF whose rule ranks deliver :meth:`snap` ``(cf)``."""
        return float(self.knobs[self._piece(cf)])


def orthonormalize(a: Tensor) -> Tensor:
    """An orthonormal basis (``dim x r``) whose leading columns span those of ``a`` (``dim >= r``).

    Householder QR (``torch.linalg.qr``): ``Q`` is a product of reflections, so its columns are
    orthonormal to rounding even when ``a`` is rank deficient. A zero or repeated column leaves the
    reflection as it is and ``Q`` completes the basis with other directions, where Gram-Schmidt
    would divide by a zero norm (NaN) or need an epsilon that leaves a column that is not unit.
    The result is a deterministic function of ``a``, identical on every rank that holds ``a``.
    """
    return torch.linalg.qr(a, mode="reduced").Q


def fit_basis(
    basis: Tensor | None,
    dim: int,
    rank: int,
    gen: torch.Generator,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """An orthonormal ``dim x rank`` basis that extends ``basis`` (``None``: a random one).

    Fewer columns than ``basis`` has: its leading columns. More: ``basis`` followed by random
    columns from ``gen``, re-orthonormalised (the span of ``basis`` is kept).
    """
    have = 0 if basis is None else basis.shape[1]
    if basis is not None and rank <= have:
        return basis[:, :rank]
    fresh = torch.randn(dim, rank - have, generator=gen, dtype=dtype, device=device)
    return orthonormalize(fresh if basis is None else torch.cat([basis, fresh], dim=1))


@dataclass(frozen=True)
class PowerSGDPayload(Payload):
    """What travels: this step's factors of every compressed matrix, and the dense values.

    Attributes:
        factors: flat concatenation of the factors (``P`` or ``Q``) in layout order, float32.
        dense: flat concatenation of the tensors sent dense, in the input's dtype.
    """

    factors: Tensor
    dense: Tensor


@dataclass(frozen=True)
class TensorPlan:
    """How one tensor of the bucket was sent.

    Attributes:
        index: position in the layout.
        start: offset of the tensor in the flat bucket.
        rows, cols: the matrix view ``(shape[0], numel / shape[0])``.
        rank: the rank used, or 0 if the tensor was sent dense.
        side: :data:`LEFT` (sent ``M @ basis``) or :data:`RIGHT` (sent ``M^T @ basis``).
        basis: the shared orthonormal basis used (``cols x rank`` if LEFT, ``rows x rank`` if
            RIGHT), ``None`` if dense.
        offset: offset of its values in ``factors`` (or in ``dense`` if dense).
    """

    index: int
    start: int
    rows: int
    cols: int
    rank: int
    side: int
    basis: Tensor | None
    offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def factor_rows(self) -> int:
        """Rows of the factor sent: ``rows`` on a left step, ``cols`` on a right one."""
        return self.rows if self.side == LEFT else self.cols


@dataclass(frozen=True)
class PowerSGDContext(Context):
    """The sender's context: the bucket key and layout, and a plan per tensor."""

    key: int
    layout: tuple[torch.Size, ...]
    plans: tuple[TensorPlan, ...]


@dataclass
class _KeyState:
    """Shared bases of one bucket key: per tensor index, (orthonormal basis, side to send next)."""

    layout: tuple[torch.Size, ...]
    bases: dict[int, tuple[Tensor, int]]


def _product(payload: PowerSGDPayload, plan: TensorPlan) -> tuple[Tensor, Tensor]:
    """``(A, B^T)`` with ``A B^T`` the matrix ``plan`` reconstructs from the factor sent:
    LEFT, ``P Q^T`` with ``P`` the factor; RIGHT, ``P^ Q^T`` with ``Q`` the factor. Both are
    ``(rows, cols)``."""
    if plan.basis is None:
        raise ValueError(f"tensor {plan.index} is sent dense: it has no factor")
    size = plan.factor_rows * plan.rank
    f = payload.factors[plan.offset : plan.offset + size].view(plan.factor_rows, plan.rank)
    return (f, plan.basis.t()) if plan.side == LEFT else (plan.basis, f.t())


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def _project(m: Tensor, plan: TensorPlan, out: Tensor) -> None:
    """Write the factor ``plan`` sends for the matrix ``m`` into the flat ``out``: ``M Q``
    (LEFT) or ``M^T P^`` (RIGHT), row-major.

    .. note::
       ``M^T P^`` is computed as ``(P^^T M)^T``: BLAS reads a transposed ``M`` on a path about
       seven times slower (for a rank-4 factor of a 512 x 2048 matrix). The dot products are the
       same but BLAS sums them in another blocking order, so the factor differs from
       ``M.t() @ P^`` in the last bits.
    """
    if plan.basis is None:
        raise ValueError(f"tensor {plan.index} is sent dense: it has no factor")
    if plan.side == LEFT:
        torch.mm(m, plan.basis, out=out.view(plan.rows, plan.rank))
    else:
        out.view(plan.cols, plan.rank).copy_((plan.basis.t() @ m).t())


def _matrix_view(shape: torch.Size) -> tuple[int, int]:
    numel = math.prod(shape)
    rows = shape[0] if len(shape) else 1
    return rows, (numel // rows if rows else 0)


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@register
class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD with alternating factors, warm start and seeded shared bases.

    Args:
        seed: seed of the shared random bases (an integer >= 0, the same on every rank).
        warm_start: reuse the aggregated factor of the previous step as the next basis (the
            power iteration); ``False`` draws a fresh seeded basis every step.
        min_compression_rate: compress a matrix only if ``mn / (r (m + n)) >=`` this (>= 1).
        min_numel: tensors with fewer elements are sent dense (an integer >= 0).
    """

    name: ClassVar[str] = "powersgd"
    collective: Collective = "allreduce"
    takes_ranks: ClassVar[bool] = True

    def __init__(
        self,
        *,
        seed: int = DEFAULT_SEED,
        warm_start: bool = True,
        min_compression_rate: float = DEFAULT_MIN_COMPRESSION_RATE,
        min_numel: int = DEFAULT_MIN_NUMEL,
    ) -> None:
        self.seed = _check_int("seed", seed, 0)
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
        self.warm_start = warm_start
        rate = min_compression_rate
        if (
            isinstance(rate, bool)
            or not isinstance(rate, int | float)
            or not math.isfinite(rate)
            or rate < 1
        ):
            raise ValueError(f"min_compression_rate must be a finite number >= 1, got {rate!r}")
        self.min_compression_rate = float(rate)
        self.min_numel = _check_int("min_numel", min_numel, 0)
        # Per bucket key: the shared bases, identical on every rank (updated by combine()).
        self._state: dict[int, _KeyState] = {}
        # Decompressed tensors, reused once the caller has dropped them.
        self._buffers = BufferPool()
        # The deliverable CFs of the bound layout (bind_shapes), and that layout.
        self._table: RankTable | None = None
        self._table_shapes: tuple[torch.Size, ...] = ()

    # --- planning -------------------------------------------------------------------------

    def rank_for(self, shape: torch.Size, cf: float) -> int:
        """Rank a tensor of ``shape`` is sent at for CF ``cf``; 0 means dense."""
        return int(self._ranks(shape, np.array([check_cf(cf)]))[0])

    def rank_given(self, shape: torch.Size, rank: int) -> int:
        """Rank a tensor of ``shape`` is sent at when ``rank`` is asked for
        (:attr:`Round.ranks`): ``rank``, or 0 (dense) where the CF rule sends it dense (too
        few dimensions or elements, or a rate ``mn / (r (m + n))`` below
        ``min_compression_rate``, as every rank above ``min(m, n)`` has: the rate is then
        below 1)."""
        numel = math.prod(shape)
        if len(shape) < 2 or numel == 0 or numel < self.min_numel:
            return 0
        m, n = _matrix_view(shape)
        return rank if m * n / (rank * (m + n)) >= self.min_compression_rate else 0

    def _ranks(self, shape: torch.Size, cfs: np.ndarray) -> np.ndarray:
        """:meth:`rank_for` over an array of CFs (the same floating-point operations as
        :func:`rank_for_cf`, so both agree exactly)."""
        numel = math.prod(shape)
        if len(shape) < 2 or numel == 0 or numel < self.min_numel:
            return np.zeros(cfs.shape, dtype=np.int64)
        m, n = _matrix_view(shape)
        r = np.clip(np.floor(m * n / (cfs * (m + n))), 1, min(m, n)).astype(np.int64)
        return np.where(m * n / (r * (m + n)) >= self.min_compression_rate, r, 0)

    def bind_shapes(self, shapes: Sequence[torch.Size]) -> None:
        """Plan ranks over the whole layout (:class:`RankTable`): from now on
        :meth:`deliverable_cf` snaps to the CFs these shapes can be sent at, and compressing at
        such a CF uses the ranks that deliver it."""
        shapes = tuple(torch.Size(s) for s in shapes)
        if self._table is None or self._table_shapes != shapes:
            self._table, self._table_shapes = RankTable(shapes, self._ranks), shapes

    def deliverable_cf(self, cf: float, world_size: int = 1) -> float:
        """The rank-rule CF (docs/design.md section 1) nearest ``cf`` that the bound layout
        (:meth:`bind_shapes`) can be sent at; ``cf`` itself before one is bound."""
        cf = check_cf(cf)
        return cf if self._table is None else self._table.snap(cf)

    def _knob(self, cf: float) -> float:
        """The CF the rank rule is applied at for a requested ``cf``."""
        return cf if self._table is None else self._table.knob(cf)

    @staticmethod
    def _layout(x: Tensor, rnd: Round) -> tuple[torch.Size, ...]:
        if rnd.layout is None:
            return (x.shape,)
        layout = tuple(torch.Size(s) for s in rnd.layout)
        total = sum(math.prod(s) for s in layout)
        if total != x.numel():
            raise ValueError(
                f"Round.layout must describe x: its shapes hold {total} elements, x has {x.numel()}"
            )
        return layout

    def _stored(self, key: int, layout: tuple[torch.Size, ...]) -> dict[int, tuple[Tensor, int]]:
        state = self._state.get(key)
        if not self.warm_start or state is None or state.layout != layout:
            return {}  # no state yet, or the bucket changed: start afresh (combine resets it)
        return state.bases

    def _basis(
        self,
        rnd: Round,
        matrix: tuple[int, int],
        index: int,
        rank: int,
        stored: tuple[Tensor, int] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[Tensor, int]:
        """The shared basis (``dim x rank``) and side for tensor ``index`` this step.

        Random columns, where needed, come from a generator seeded by (seed, key, index, step,
        columns kept, rank): the same on every rank, and the same for every compress() call of
        the step at that rank.
        """
        old, side = (None, LEFT) if stored is None else stored
        dim = matrix[1] if side == LEFT else matrix[0]
        have = 0
        if old is not None:
            old = old.to(device=device, dtype=dtype)
            have = old.shape[1]
            if rank <= have:
                return old[:, :rank], side
        gen = generator(device, self.seed, _BASIS_STREAM, rnd.key, index, rnd.step, have, rank)
        return fit_basis(old, dim, rank, gen, dtype=dtype, device=device), side

    # --- the Compressor interface -----------------------------------------------------------

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[PowerSGDPayload, PowerSGDContext]:
        cf = self._knob(check_cf(cf))
        flat = x.detach().reshape(-1)
        layout = self._layout(x, rnd)
        dtype = _compute_dtype(x.dtype)
        stored = self._stored(rnd.key, layout)
        plans: list[TensorPlan] = []
        start = n_factor = n_dense = 0
        if rnd.ranks is not None and len(rnd.ranks) != len(layout):
            raise ValueError(
                f"Round.ranks must give a rank for each of the layout's {len(layout)} tensors, "
                f"got {rnd.ranks}"
            )
        for index, shape in enumerate(layout):
            rows, cols = _matrix_view(shape)
            if rnd.ranks is None:
                rank = self.rank_for(shape, cf)
            else:
                rank = self.rank_given(shape, rnd.ranks[index])
            if rank == 0:
                plans.append(TensorPlan(index, start, rows, cols, 0, LEFT, None, n_dense))
                n_dense += rows * cols
            else:
                basis, side = self._basis(
                    rnd, (rows, cols), index, rank, stored.get(index), dtype, flat.device
                )
                plan = TensorPlan(index, start, rows, cols, rank, side, basis, n_factor)
                plans.append(plan)
                n_factor += plan.factor_rows * rank
            start += rows * cols
        # the factors and dense values are written in place: no per-tensor results to concatenate
        payload = PowerSGDPayload(
            factors=flat.new_empty(n_factor, dtype=dtype), dense=flat.new_empty(n_dense)
        )
        for plan in plans:
            seg = flat[plan.start : plan.start + plan.numel]
            if plan.basis is None:
                payload.dense[plan.offset : plan.offset + plan.numel].copy_(seg)
            else:
                size = plan.factor_rows * plan.rank
                out = payload.factors[plan.offset : plan.offset + size]
                _project(seg.view(plan.rows, plan.cols).to(dtype), plan, out)
        sent = n_factor + n_dense
        achieved = flat.numel() / sent if sent else 1.0
        ctx = PowerSGDContext(
            x.shape, x.dtype, flat.numel(), achieved, key=rnd.key, layout=layout, plans=tuple(plans)
        )
        return payload, ctx

    def forget(self, key: int) -> None:
        """Drop the shared bases of unit ``key``."""
        self._state.pop(key, None)

    def sent_terms(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """Both terms are ``||f||^2`` summed over the factors sent, plus ``||dense||^2``: with
        the orthonormal basis ``B`` not sent, a left step sends ``f = M B`` for ``c = f B^T``,
        so ``<c, M> = <f, M B> = ||f||^2`` and ``||c||^2 = ||f||^2`` (``B^T B = I``); a right
        step likewise. No dense decompression (equal to it up to the basis' rounding)."""
        p = cast(PowerSGDPayload, payload)
        total = squared_norm(p.factors) + squared_norm(p.dense)
        return torch.stack([total, total])

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """``M - P Q^T`` by one GEMM per matrix into ``x``'s storage (``addmm``, not a dense
        decompression and a subtraction: equal to ``x - D(payload)`` to a rounding); the
        tensors sent dense leave exact zeros. Subnormal entries are flushed to zero
        (:func:`~gravac.kernels.subnormal.flush_subnormal_`)."""
        if not x.is_contiguous():
            return flush_subnormal_(super().residual_(x, payload, ctx))
        p, c = cast(PowerSGDPayload, payload), cast(PowerSGDContext, ctx)
        flat = x.view(-1)
        for plan in c.plans:
            seg = flat[plan.start : plan.start + plan.numel]
            if plan.basis is None:
                seg.sub_(p.dense[plan.offset : plan.offset + plan.numel])
                continue
            a, bt = _product(p, plan)
            m = seg.view(plan.rows, plan.cols)
            if m.dtype == a.dtype:
                m.addmm_(a, bt, alpha=-1)
            else:
                m.sub_((a @ bt).to(m.dtype))
        return flush_subnormal_(x)

    def mean_bound(self, ctx: Context, world_size: int, x_bound: float) -> float:
        """``N sqrt(r max(m, n)) x_bound``: a factor's row is a row or column of ``M`` (at most
        ``sqrt(max(m, n)) x_bound`` long) times the orthonormal basis, summed over ``N``
        ranks, and an entry of ``P Q^T`` is the product of a factor's row and a basis row (at
        most ``sqrt(r)`` long); dense tensors travel as they are."""
        c = cast(PowerSGDContext, ctx)
        spread = max(
            (math.sqrt(max(1, p.rank) * max(p.rows, p.cols)) for p in c.plans), default=1.0
        )
        return world_size * max(1.0, spread) * x_bound

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        """Dense values as sent; ``P Q^T`` with the context's shared basis for each matrix."""
        return self.decompress_into(payload, ctx, None)

    def decompress_into(self, payload: Payload, ctx: Context, out: Tensor | None) -> Tensor:
        p, c = cast(PowerSGDPayload, payload), cast(PowerSGDContext, ctx)
        if out is None:
            out = self._buffers.empty(c.numel, c.dtype, p.dense.device, "decompressed")
        for plan in c.plans:
            seg = out[plan.start : plan.start + plan.numel]
            if plan.basis is None:
                seg.copy_(p.dense[plan.offset : plan.offset + plan.numel])
                continue
            # written into the output in the gradient's dtype (through a copy if it differs)
            a, bt = _product(p, plan)
            if seg.dtype == a.dtype:
                torch.mm(a, bt, out=seg.view(plan.rows, plan.cols))
            else:
                seg.view(plan.rows, plan.cols).copy_(a @ bt)
        return out.view(c.shape)

    def combine(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None = None
    ) -> Tensor:
        """Sum the payloads (the all-reduce), decompress, and advance the shared bases.

        Every rank calls this exactly once per round with the same aggregate, so every rank
        orthonormalises the same summed factors into the same next basis and flips the side.
        A non-finite aggregated factor leaves that tensor's basis as it was (the optimizer skips
        such a step; a NaN basis would poison every later step).
        """
        if not payloads:
            raise ValueError("combine() needs at least one payload, got none")
        total = cast(PowerSGDPayload, sum_payloads(payloads))
        c = cast(PowerSGDContext, ctx)
        out = self.decompress_into(total, c, out)
        if self.warm_start:
            self._advance(total, c)
        return out

    def _advance(self, total: PowerSGDPayload, ctx: PowerSGDContext) -> None:
        old = self._state.get(ctx.key)
        # Tensors sent dense this round keep their bases, unless the bucket's layout changed.
        bases = dict(old.bases) if old is not None and old.layout == ctx.layout else {}
        all_finite = bool(torch.isfinite(total.factors).all())
        for plan in ctx.plans:
            if plan.basis is None:
                continue
            size = plan.factor_rows * plan.rank
            f = total.factors[plan.offset : plan.offset + size].view(plan.factor_rows, plan.rank)
            if not all_finite and not bool(torch.isfinite(f).all()):
                continue
            bases[plan.index] = (orthonormalize(f), RIGHT if plan.side == LEFT else LEFT)
        self._state[ctx.key] = _KeyState(layout=ctx.layout, bases=bases)

    # --- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every key's layout, shared bases and sides (tensors, lists and ints)."""
        return {
            "keys": {
                key: {
                    "layout": [list(s) for s in st.layout],
                    "bases": {i: b.clone() for i, (b, _) in st.bases.items()},
                    "sides": {i: side for i, (_, side) in st.bases.items()},
                }
                for key, st in self._state.items()
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"keys"})
        if unknown:
            raise ValueError(f"powersgd state has unknown entries {unknown}; expected ['keys']")
        loaded: dict[int, _KeyState] = {}
        for key, entry in state.get("keys", {}).items():
            layout = tuple(torch.Size(s) for s in entry["layout"])
            bases: dict[int, tuple[Tensor, int]] = {}
            for i, basis in entry["bases"].items():
                side = int(entry["sides"][i])
                basis = torch.as_tensor(basis).clone()
                index = int(i)
                if side not in (LEFT, RIGHT) or not 0 <= index < len(layout):
                    raise ValueError(
                        f"powersgd state of key {key}: tensor {index} with side {side} does not "
                        f"fit a layout of {len(layout)} tensors (sides are {LEFT} or {RIGHT})"
                    )
                rows, cols = _matrix_view(layout[index])
                dim = cols if side == LEFT else rows
                if basis.dim() != 2 or basis.shape[0] != dim:
                    raise ValueError(
                        f"powersgd state of key {key}: basis {index} has shape "
                        f"{tuple(basis.shape)}, expected ({dim}, rank) for shape "
                        f"{tuple(layout[index])}"
                    )
                bases[index] = (basis, side)
            loaded[int(key)] = _KeyState(layout=layout, bases=bases)
        self._state = loaded

    def __repr__(self) -> str:
        return (
            f"PowerSGDCompressor(seed={self.seed}, warm_start={self.warm_start}, "
            f"min_compression_rate={self.min_compression_rate}, min_numel={self.min_numel})"
        )
