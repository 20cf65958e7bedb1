"""TopK Chunked (TopKC): Top-k over fixed chunks agreed by all ranks, aggregated by all-reduce.

From "Beyond Throughput and Compression Ratios: Towards High End-to-end Utility of Gradient
Compression" (HotNets 2024; docs/design.md section 10). Plain Top-k needs an all-gather
because every rank keeps different entries. TopKC splits the flat gradient ``x`` (``d`` elements)
into chunks of ``c`` consecutive elements and lets the ranks *agree* on which chunks to send::

    s_j   = sum over ranks i of ||x_i[chunk j]||^2          (one small all-reduce of d / c floats)
    order = chunks sorted by s_j descending, ties by chunk index ascending (identical everywhere)
    send  = the leading k = round(d / CF) elements of x laid out chunk after chunk in that order

so every rank sends the values of the same positions, in the same order, and the payloads are
summed by an all-reduce. Decompression scatters the (summed) values back to their positions.

Multi-level compression (docs/design.md section 7) is exact: the elements kept at a larger CF are a
prefix of those kept at a smaller one, so :meth:`TopKCCompressor.recompress` takes a prefix of the
payload and equals compressing the input directly at the larger CF, bit for bit.

.. note::
   The paper's description keeps whole chunks (``ceil(n_chunks / CF)`` of them). We keep the same
   chunks, but cut the last one short so that exactly ``k = round(d / CF)`` elements travel, the
   budget of every other sparsifier: the achieved CF then matches the requested one even when the
   tensor holds only a few chunks (a whole-chunk rule gives CF 39 or 625 for a request of 100 on
   10 000 elements in chunks of 256). The cut chunk keeps its leading elements.

.. note::
   With no agreement step (``Round.agreed is None``, e.g. a single worker compressing on its own)
   the rank ranks chunks by its own squared norms; with several workers that would break the
   all-reduce, so the caller must always pass the reduced :meth:`TopKCCompressor.local_stats`.
   Non-finite chunk norms rank above every finite one, so NaN and Inf are sent, never hidden in a
   residual.
"""

from __future__ import annotations

import math
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
    StatsRule,
    agreed_stats,
    check_cf,
    k_for_cf,
)
from gravac.compressors.registry import register
from gravac.gain import kept_terms

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TopKCCompressor",
    "TopKCContext",
    "TopKCPayload",
    "chunk_sq_norms",
    "kept_positions",
    "rank_chunks",
]

#: Elements per chunk. 256 float32 values are 1 KiB: the agreement all-reduce then carries
#: d / 256 floats (0.4% of the dense gradient, negligible next to the payload at any CF below
#: about 250), while chunks stay small enough to follow where the gradient's energy is (a layer's
#: rows, an embedding's rows). It is also a multiple of a GPU warp and of a cache line's floats.
DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class TopKCPayload(Payload):
    """The kept values (input dtype), chunk after chunk in agreed rank order."""

    values: Tensor


@dataclass(frozen=True)
class TopKCContext(Context):
    """What the sender keeps: the kept chunks and how many elements were sent.

    Attributes:
        chunk_ids: int64 ids of the chunks touched, in agreed rank order (the last one may be cut).
        chunk_size: elements per chunk (the last chunk of ``x`` may be shorter).
        kept: number of elements sent (``values.numel()``).
    """

    chunk_ids: Tensor
    chunk_size: int
    kept: int


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs (their squares overflow fp16), float64 kept as it is."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def chunk_sq_norms(flat: Tensor, chunk_size: int) -> Tensor:
    """Squared L2 norm of each chunk of ``chunk_size`` consecutive elements of 1-D ``flat``.

    Returns ``ceil(d / chunk_size)`` values (float32, or float64 for float64 input); the last
    chunk may be short. Computed as the square of ``torch.linalg.vector_norm`` over the rows of
    a view (one pass, no squared copy of the gradient, a tenth of the time of
    ``square().sum()``); every rank ranks the same all-reduced sums, so the last-bit rounding
    of the square root does not matter.
    """
    dtype = _stats_dtype(flat.dtype)
    full = flat.numel() // chunk_size * chunk_size
    rows = flat[:full].view(-1, chunk_size)
    norms = torch.linalg.vector_norm(rows, dim=1, dtype=dtype)
    if full < flat.numel():
        tail = torch.linalg.vector_norm(flat[full:], dtype=dtype).reshape(1)
        norms = torch.cat([norms, tail])
    return norms.square_()


def rank_chunks(norms: Tensor, count: int | None = None) -> Tensor:
    """Chunk ids by ``norms`` descending, ties broken by id ascending (int64); only the first
    ``count`` if given.

    NaN ranks with +Inf, above every finite norm. A stable sort preserves the id order of equal
    keys, so the ranking is a pure function of ``norms``: identical on every rank. The first
    ``count`` are found without sorting every chunk: the chunks whose key is at least the
    ``count``-th largest (ties included), in id order, sorted stably, are exactly the full
    ranking's first ones.
    """
    keys = torch.nan_to_num(norms, nan=math.inf)
    if count is None or count >= keys.numel():
        return torch.sort(keys, descending=True, stable=True).indices
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    t = torch.topk(keys, count, sorted=False).values.min()
    candidates = torch.nonzero(keys >= t).reshape(-1)
    order = torch.sort(keys.index_select(0, candidates), descending=True, stable=True).indices
    return candidates.index_select(0, order[:count])


def _chunk_lengths(chunk_ids: Tensor, numel: int, chunk_size: int) -> Tensor:
    """Elements in each chunk of ``chunk_ids`` (``chunk_size``, less for the last chunk of x)."""
    last = math.ceil(numel / chunk_size) - 1
    short = numel - last * chunk_size
    full = torch.full_like(chunk_ids, chunk_size)
    return torch.where(chunk_ids == last, torch.full_like(chunk_ids, short), full)


def _cover(chunk_ids: Tensor, k: int, numel: int, chunk_size: int) -> Tensor:
    """The leading chunks of ``chunk_ids`` whose elements first reach ``k`` in total."""
    if k == 0:
        return chunk_ids[:0]
    cum = torch.cumsum(_chunk_lengths(chunk_ids, numel, chunk_size), dim=0)
    need = int(torch.searchsorted(cum, torch.tensor([k], device=cum.device)).item()) + 1
    return chunk_ids[:need]


def kept_positions(chunk_ids: Tensor, k: int, numel: int, chunk_size: int) -> Tensor:
    """Flat int64 positions of the first ``k`` elements of the chunks ``chunk_ids``, in order."""
    offsets = torch.arange(chunk_size, device=chunk_ids.device)
    pos = (chunk_ids.unsqueeze(1) * chunk_size + offsets).reshape(-1)
    if numel % chunk_size:
        pos = pos[pos < numel]  # drop the padding of the short last chunk, if it is kept
    return pos[:k]


@register
class TopKCCompressor(Compressor):
    """Chunked Top-k whose chunks are chosen by norms all ranks agree on (all-reduce).

    For a requested CF the ``k = round(d / CF)`` sent elements are the leading elements of the
    chunks ranked by the agreed squared norms (:func:`chunk_sq_norms` summed over ranks); the
    achieved CF is ``d / k``.

    Args:
        chunk_size: elements per chunk (an integer >= 1; default :data:`DEFAULT_CHUNK_SIZE`).
    """

    name: ClassVar[str] = "topkc"
    collective: Collective = "allreduce"
    #: the chunks' squared norms, summed over ranks
    stats_rule: ClassVar[StatsRule] = StatsRule(op="sum", degree=2)  # squared norms

    def __init__(self, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def local_stats(self, x: Tensor, cf: float, rnd: Round) -> Tensor:
        """This rank's squared chunk norms; the sum over ranks ranks the chunks."""
        return chunk_sq_norms(x.detach().reshape(-1), self.chunk_size)

    def _norms(self, flat: Tensor, rnd: Round) -> Tensor:
        """The agreed squared chunk norms (this rank's alone, with one rank).

        Raises:
            ValueError: they are missing with more than one rank (each rank would rank its own
                chunks and the all-reduce would add values at different positions), or of the
                wrong shape.
        """
        if rnd.agreed is None:
            return cast(Tensor, agreed_stats(self, flat, 1.0, rnd))
        n_chunks = math.ceil(flat.numel() / self.chunk_size)
        if rnd.agreed.shape != (n_chunks,):
            raise ValueError(
                f"Round.agreed must hold one norm per chunk, shape ({n_chunks},) for "
                f"{flat.numel()} elements in chunks of {self.chunk_size}; "
                f"got {tuple(rnd.agreed.shape)}"
            )
        return rnd.agreed.to(flat.device)

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[TopKCPayload, TopKCContext]:
        flat = x.detach().reshape(-1)
        k = k_for_cf(flat.numel(), cf)
        # k elements span at most ceil(k / c) + 1 chunks (the short last chunk may be one)
        order = rank_chunks(self._norms(flat, rnd), -(-k // self.chunk_size) + 1)
        ids = _cover(order, k, flat.numel(), self.chunk_size)
        pos = kept_positions(ids, k, flat.numel(), self.chunk_size)
        ctx = self._context(x.shape, x.dtype, flat.numel(), ids, k)
        return TopKCPayload(values=flat.index_select(0, pos)), ctx

    def _context(
        self, shape: torch.Size, dtype: torch.dtype, numel: int, ids: Tensor, k: int
    ) -> TopKCContext:
        cf = numel / k if k else 1.0
        return TopKCContext(shape, dtype, numel, cf, ids, self.chunk_size, k)

    def recompress(
        self, payload: Payload, ctx: Context, cf: float, rnd: Round
    ) -> tuple[TopKCPayload, TopKCContext]:
        """Keep the leading elements of the kept ones: equal to compressing directly at ``cf``."""
        p, c = cast(TopKCPayload, payload), cast(TopKCContext, ctx)
        k = min(k_for_cf(c.numel, check_cf(cf)), c.kept)
        ids = _cover(c.chunk_ids, k, c.numel, c.chunk_size)
        return TopKCPayload(values=p.values[:k]), self._context(c.shape, c.dtype, c.numel, ids, k)

    def sent_terms(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """From the values sent, entries of ``x`` (:func:`gravac.gain.kept_terms`)."""
        return kept_terms(cast(TopKCPayload, payload).values)

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """``x`` with the kept positions zeroed, in place: bit for bit ``x - D(payload)``."""
        c = cast(TopKCContext, ctx)
        pos = kept_positions(c.chunk_ids.to(x.device), c.kept, c.numel, c.chunk_size)
        x.view(-1).index_fill_(0, pos, 0)
        return x

    def mean_bound(self, ctx: Context, world_size: int, x_bound: float) -> float:
        """``world_size x_bound``: the values sent are entries of ``x``, summed by the
        all-reduce."""
        return world_size * x_bound

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        return self.decompress_into(payload, ctx, None)

    def decompress_into(self, payload: Payload, ctx: Context, out: Tensor | None) -> Tensor:
        p, c = cast(TopKCPayload, payload), cast(TopKCContext, ctx)
        if out is None:
            out = torch.zeros(c.numel, dtype=c.dtype, device=p.values.device)
        else:
            out.zero_()
        pos = kept_positions(c.chunk_ids.to(out.device), c.kept, c.numel, c.chunk_size)
        out.index_copy_(0, pos, p.values.to(c.dtype))
        return out.view(c.shape)

    def __repr__(self) -> str:
        return f"TopKCCompressor(chunk_size={self.chunk_size})"
