"""Shared machinery of the all-gather sparsifiers (Top-k, DGC, RedSync).

Each keeps exactly ``k = round(d / CF)`` elements (:func:`gravac.compressors.base.k_for_cf`), so
every rank's payload has the same, CF-determined size and can be all-gathered without a size
exchange. Subclasses only choose *which* k elements (:meth:`SparseCompressor.select`); the
payload, decompression, fused aggregation and multi-level compression are common.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor

from gravac.compressors.base import (
    Collective,
    Compressor,
    Context,
    Payload,
    Round,
    check_cf,
    k_for_cf,
)
from gravac.gain import kept_terms
from gravac.kernels import index_dtype, scatter_add, topk_indices
from gravac.spans import Place, place_indices

__all__ = ["BREAK_EVEN_CF", "PLACE_RATIO", "SparseCompressor", "SparsePayload"]

#: the CF at or below which a sparsifier's payload is no smaller than the dense tensor: a float32
#: value and its int32 index (8 bytes) for every CF float32 elements (4 bytes each); such a
#: tensor is sent dense (:attr:`SparseCompressor.dense_at_one`)
BREAK_EVEN_CF = 2.0

#: the gathered indices are moved into a bucket's spans (not the aggregate copied there) while
#: indices x span boundaries <= numel / PLACE_RATIO: one thread moved an index across a
#: boundary in 2.3 ns and copied an aggregate element in 0.39 ns (105K indices, 5.3M elements,
#: ``gravac.spans.place_indices`` against ``Tensor.copy_``), a ratio of 6, with room to spare
PLACE_RATIO = 8


@dataclass(frozen=True)
class SparsePayload(Payload):
    """Exactly k values (input dtype) and their flat indices (int32 below 2^31 elements)."""

    values: Tensor
    indices: Tensor


class SparseCompressor(Compressor):
    """Base of the sparsifiers that send values and indices through an all-gather."""

    collective: Collective = "allgather"
    dense_at_one: ClassVar[bool] = True

    def deliverable_cf(self, cf: float, world_size: int = 1) -> float:
        """``cf``, or 1 (the tensor sent dense) at or below :data:`BREAK_EVEN_CF`, where values
        and indices would be no fewer bytes than the dense tensor."""
        return 1.0 if check_cf(cf) <= BREAK_EVEN_CF else cf

    @abstractmethod
    def select(self, values: Tensor, k: int, rnd: Round) -> Tensor:
        """int64 positions of the ``k`` entries of 1-D ``values`` to send (exactly ``k``).

        Only called with ``0 < k < values.numel()``: :meth:`_choose` handles the trivial cases.
        """

    def _choose(self, values: Tensor, k: int, rnd: Round) -> Tensor:
        """:meth:`select`, except that keeping nothing or everything needs no selection."""
        if k == 0:
            return torch.empty(0, dtype=torch.int64, device=values.device)
        if k >= values.numel():
            return torch.arange(values.numel(), device=values.device)
        return self.select(values, k, rnd)

    def shadow_kept(self, values: Tensor, cf: float) -> Tensor:
        """The ``round(n / cf)`` largest magnitudes of the sample: every sparsifier here keeps
        (about) the largest, so an exact top-k stands for them all, and needs no round's
        randomness or per-key state."""
        return topk_indices(values, k_for_cf(values.numel(), cf))

    def _payload(
        self, values: Tensor, indices: Tensor, numel: int, shape: torch.Size, dtype: torch.dtype
    ) -> tuple[SparsePayload, Context]:
        k = values.numel()
        cf = numel / k if k else 1.0
        payload = SparsePayload(values=values, indices=indices.to(index_dtype(numel)))
        return payload, Context(shape=shape, dtype=dtype, numel=numel, achieved_cf=cf)

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[SparsePayload, Context]:
        flat = x.detach().reshape(-1)
        k = k_for_cf(flat.numel(), cf)
        idx = self._choose(flat, k, rnd)
        return self._payload(flat.index_select(0, idx), idx, flat.numel(), x.shape, x.dtype)

    def recompress(
        self, payload: Payload, ctx: Context, cf: float, rnd: Round
    ) -> tuple[SparsePayload, Context]:
        p = cast(SparsePayload, payload)
        k = min(k_for_cf(ctx.numel, check_cf(cf)), p.values.numel())
        sub = self._choose(p.values, k, rnd)
        values, indices = p.values.index_select(0, sub), p.indices.index_select(0, sub)
        return self._payload(values, indices, ctx.numel, ctx.shape, ctx.dtype)

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        p = cast(SparsePayload, payload)
        return scatter_add(ctx.numel, p.indices, p.values.to(ctx.dtype)).view(ctx.shape)

    def sent_terms(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """From the values sent, entries of ``x`` (:func:`gravac.gain.kept_terms`)."""
        return kept_terms(cast(SparsePayload, payload).values)

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """The values sent are ``x`` at the indices: the residual is ``x`` with them zeroed,
        bit for bit ``x - D(payload)``, in place."""
        indices = cast(SparsePayload, payload).indices  # int32 where they fit: no int64 copy
        x.view(-1).index_put_((indices,), x.new_zeros(()))
        return x

    def mean_bound(self, ctx: Context, world_size: int, x_bound: float) -> float:
        """``x_bound``: the values sent are entries of ``x``, and :meth:`combine_mean` divides
        them by ``world_size`` before summing the ``world_size`` values of one position."""
        return x_bound

    def combine(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None = None
    ) -> Tensor:
        """Sum of all gathered payloads in one scatter-add, rank order preserved."""
        return self._scatter(payloads, ctx, out, 1)

    def combine_mean(
        self,
        payloads: Sequence[Payload],
        ctx: Context,
        world_size: int,
        out: Tensor | None = None,
    ) -> Tensor:
        """The gathered values divided by ``world_size`` (``k N`` elements, not a pass over the
        dense result), then scatter-added: ``sum_r v_r / N``, bit for bit the sum divided
        for a power-of-two ``N`` (barring subnormals), within a rounding otherwise."""
        return self._scatter(payloads, ctx, out, world_size)

    def combine_mean_placed(
        self, payloads: Sequence[Payload], ctx: Context, world_size: int, place: Place
    ) -> bool:
        """:meth:`combine_mean` scatter-added straight into the place's spans (zeroed first),
        at the flat positions moved into them (:func:`gravac.spans.place_indices`): the same
        sums in the same order. Not where moving the ``K`` gathered indices costs more than
        copying the aggregate: ``K (len(spans) - 1) > numel /`` :data:`PLACE_RATIO`."""
        out, spans = place
        moves = sum(cast(SparsePayload, p).indices.numel() for p in payloads) * (len(spans) - 1)
        if moves * PLACE_RATIO > ctx.numel:
            return False
        indices, values = self._gathered(payloads, ctx, world_size)
        for a, b in spans:
            out[a:b].zero_()
        out.index_add_(0, place_indices(indices, spans), values)
        return True

    def _scatter(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None, divisor: int
    ) -> Tensor:
        indices, values = self._gathered(payloads, ctx, divisor)
        return scatter_add(ctx.numel, indices, values, out=out).view(ctx.shape)

    @staticmethod
    def _gathered(payloads: Sequence[Payload], ctx: Context, divisor: int) -> tuple[Tensor, Tensor]:
        """Every payload's indices and values, concatenated in rank order, the values in
        ``ctx``'s dtype and divided by ``divisor``."""
        if not payloads:
            raise ValueError("combine() needs at least one payload, got none")
        ps = [cast(SparsePayload, p) for p in payloads]
        values = torch.cat([p.values.reshape(-1) for p in ps]).to(ctx.dtype)  # ours: a copy
        if divisor > 1:
            values.div_(divisor)
        return torch.cat([p.indices.reshape(-1) for p in ps]), values
