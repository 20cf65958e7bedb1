"""THCCompressor: THC behind the compressor interface (Li et al., NSDI 2024; docs/design.md
section 6).

The class checks its options, picks ``(b, g, p)`` for a requested CF, agrees the block norms
(:meth:`THCCompressor.local_stats`, reduced by ``"max"``) and hands the math to the reference
(:mod:`gravac.compressors.thc.encoding`) or to the CPU path (:mod:`gravac.compressors.thc.cpu`).
Transports (``transport``): ``"allreduce"`` sends the levels ``T[z]`` in 0..g packed into
integer lanes (:mod:`gravac.compressors.thc.lanes`) plus a one-word ``count`` that sums to the
number of contributions, so a summed payload decompresses without being told ``N``;
``"allgather"`` sends the ``b``-bit indices packed into bytes (``32 / b`` times fewer bytes than
float32), and :meth:`THCCompressor.combine` unpacks, looks up and sums the levels, then
decompresses once.

CF -> bits: ``b`` in {1, 2, 4, 8} is CF {32, 16, 8, 4} on the all-gather; a requested CF picks
the ``b`` with the largest CF not above it (CF below 4 gives ``b = 8``). On the all-reduce the
lanes set the wire CF, ``32 floor(64 / w) / 64`` (``achieved_cf``,
:meth:`THCCompressor.deliverable_cf`; ``wire_bytes`` is 8 bytes a word plus the count word), so
a requested CF picks the most precise ``b`` whose lanes deliver the largest wire CF not above it
(:meth:`THCCompressor.config`). Wire CF with the default granularities:

====  =====  =============  =============  ==============
 b     g      N = 2          N = 8          N = 64
====  =====  =============  =============  ==============
 1     1      16   (w = 2)   8    (w = 4)   4.5  (w = 7)
 2     3      10.5 (w = 3)   6    (w = 5)   4    (w = 8)
 4     30     5    (w = 6)   4    (w = 8)   2.5  (w = 11)
 8     510    3    (w = 10)  2.5  (w = 12)  2    (w = 15)
====  =====  =============  =============  ==============

Default rotation: ``"partial"`` (blocks of 2^10, per-block max-norms), decided by ``gravac bench
compressors`` (16M elements, 4 workers, CF 100, so b = 1): NMSE 0.314 partial against 0.337
full, and faster to compress and to decompress (the full rotation of 2^24 takes five GEMM passes
over memory instead of two in cache; times in docs/studies/2026-11-30-thc-cpu.md). At b = 4 on
one worker the tests bound both below 0.026 (``tests/compressors/thc/test_accuracy.py``);
``"full"`` remains available.

Defaults per bit width, ``(g, p)``, chosen by the table DP's predicted NMSE of one worker on
normal coordinates (:func:`gravac.compressors.thc.table.expected_nmse`; rounding plus clamping):

====  =====  ========  ==============  ==========================================================
 b     g      p        predicted NMSE  why
====  =====  ========  ==============  ==========================================================
 1     1      1/2      0.455           two levels {0, g}: g does not matter, p = 1/2 is the best
 2     3      1/5      0.177           the uniform table is optimal (g = 6, 12 give the same)
 4     30     1/32     0.0203          THC's defaults (p = 1/64 would give 0.0194)
 8     510    1/16384  0.000093        g = 255 (uniform) gives 0.00016 at its best p
====  =====  ========  ==============  ==========================================================
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal, cast

import torch
from torch import Tensor

from gravac.compressors.base import (
    REFERENCE_BITS,
    Collective,
    Compressor,
    Context,
    Payload,
    Round,
    StatsRule,
    agreed_stats,
    check_cf,
)
from gravac.compressors.registry import register
from gravac.compressors.thc.cpu import (
    _CPUWork,
    _decode_lanes_cpu,
    _decode_packed_cpu,
    _encode_cpu,
)
from gravac.compressors.thc.encoding import block_norms, thc_decode, thc_payload
from gravac.compressors.thc.lanes import (
    LANE_WORD_BITS,
    lane_bits,
    lanes_per_word,
    pack_lanes,
    unpack_lanes,
)
from gravac.compressors.thc.records import (
    Encoding,
    THCContext,
    THCLevelsPayload,
    THCPackedPayload,
    _compute_dtype,
)
from gravac.compressors.thc.table import VALID_BITS, clamp_threshold, optimal_table
from gravac.kernels import check_backend_name
from gravac.kernels.hadamard import next_power_of_two
from gravac.kernels.quantize import unpack_lookup_sum
from gravac.kernels.subnormal import flush_subnormal_
from gravac.seeding import derive_seed

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_P",
    "DEFAULT_PARTIAL_STAGES",
    "THCCompressor",
    "bits_for_cf",
]

#: Granularity g per bit width (module docstring table): levels are integers in 0..g.
DEFAULT_GRANULARITY: dict[int, int] = {1: 1, 2: 3, 4: 30, 8: 510}
#: Clamped fraction p per bit width (module docstring table): clamp at Phi^-1(1 - p/2).
DEFAULT_P: dict[int, float] = {1: 1 / 2, 2: 1 / 5, 4: 1 / 32, 8: 1 / 16384}
#: Butterfly stages of the partial rotation: blocks of 2^10 = 1024 elements, as THC's code.
DEFAULT_PARTIAL_STAGES = 10
#: Largest partial block, 2^30 elements (beyond that, use the full rotation).
_MAX_PARTIAL_STAGES = 30
Rotation = Literal["full", "partial"]
Transport = Literal["allreduce", "allgather"]
_ROTATIONS: tuple[Rotation, ...] = ("full", "partial")
_TRANSPORTS: tuple[Collective, ...] = ("allreduce", "allgather")
# Stream tags that keep the diagonal's and the rounding's seeds apart for one (seed, step, key).
_DIAGONAL_STREAM = 0x5448435F44494147  # "THC_DIAG"
_ROUNDING_STREAM = 0x5448435F524E4447  # "THC_RNDG"


def bits_for_cf(cf: float) -> int:
    """Bits per element for a requested CF: the largest ``32 / b <= cf``; 8 below CF 4."""
    cf = check_cf(cf)
    for bits in sorted(VALID_BITS):
        if REFERENCE_BITS / bits <= cf:
            return bits
    return max(VALID_BITS)


@register
class THCCompressor(Compressor):
    """Tensor Homomorphic Compression (:mod:`gravac.compressors.thc`).

    Args:
        bits: fix the bits per index (1, 2, 4 or 8); ``None`` picks them from the requested CF.
        granularity: ``g``, levels are integers in ``0..g``; ``None`` takes
            :data:`DEFAULT_GRANULARITY` for the bit width in use. Larger ``g`` allows a finer
            table but needs wider all-reduce lanes (``g * world_size`` must fit).
        p: fraction of normal coordinates clamped, in (0, 1); ``None`` takes :data:`DEFAULT_P`.
        rotation: ``"partial"`` (default: each block of ``2^partial_stages`` rotated and scaled
            on its own; module docstring for the measurements) or ``"full"`` (one Hadamard
            rotation of the padded input).
        partial_stages: ``log2`` of the partial rotation's block (``rotation="partial"`` only).
        transport: ``"allreduce"`` (levels in integer lanes, summed by the collective) or
            ``"allgather"`` (packed ``b``-bit indices, looked up and summed by :meth:`combine`).
        seed: user seed of the shared diagonal and of the rounding hash.
        symmetric_table: use the best mirror-symmetric table (THC's published tables) rather
            than the unrestricted optimum (a fraction of a percent less rounding error).
        backend: kernel backend (``None`` picks the best available; see :mod:`gravac.kernels`).

    Raises:
        ValueError: an option out of range (the message names the option, the value and what is
            allowed).
    """

    name: ClassVar[str] = "thc"
    #: the blocks' norms, the largest over ranks
    stats_rule: ClassVar[StatsRule] = StatsRule(op="max")

    def __init__(
        self,
        *,
        bits: int | None = None,
        granularity: int | None = None,
        p: float | None = None,
        rotation: Rotation = "partial",
        partial_stages: int = DEFAULT_PARTIAL_STAGES,
        transport: Transport = "allreduce",
        seed: int = 0,
        symmetric_table: bool = True,
        backend: str | None = None,
    ) -> None:
        if bits is not None and (isinstance(bits, bool) or bits not in VALID_BITS):
            raise ValueError(f"bits must be one of {list(VALID_BITS)} or None, got {bits!r}")
        usable = (bits,) if bits is not None else VALID_BITS
        if granularity is not None:
            need = max(2**b - 1 for b in usable)
            if isinstance(granularity, bool) or not isinstance(granularity, int):
                raise ValueError(f"granularity must be an int or None, got {granularity!r}")
            if granularity < need:
                which = f"bits={bits}" if bits is not None else "bits=8 (a CF below 8 selects it)"
                raise ValueError(
                    f"granularity must be >= 2^bits - 1 = {need} for {which}, got {granularity}; "
                    "fix bits to use a smaller granularity"
                )
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p < 1.0
        ):
            raise ValueError(f"p (the clamped fraction) must be in (0, 1) or None, got {p!r}")
        if rotation not in _ROTATIONS:
            raise ValueError(f"rotation must be one of {list(_ROTATIONS)}, got {rotation!r}")
        if (
            isinstance(partial_stages, bool)
            or not isinstance(partial_stages, int)
            or not 1 <= partial_stages <= _MAX_PARTIAL_STAGES
        ):
            raise ValueError(
                f"partial_stages must be an int in [1, {_MAX_PARTIAL_STAGES}], "
                f"got {partial_stages!r}"
            )
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {list(_TRANSPORTS)}, got {transport!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(symmetric_table, bool):
            raise ValueError(f"symmetric_table must be a bool, got {symmetric_table!r}")
        self.bits = bits
        self.granularity = granularity
        self.p = p
        self.rotation = rotation
        self.partial_stages = partial_stages
        self.transport = transport
        self.collective: Collective = transport
        self.seed = seed
        self.symmetric_table = symmetric_table
        self.backend = check_backend_name(backend)
        # Buffers of the CPU kernel, by padded length (see _cpu_work).
        self._work: dict[tuple[int, int], _CPUWork] = {}

    # -- configuration -------------------------------------------------------------------------

    def config(self, cf: float, world_size: int = 1) -> tuple[int, int, float]:
        """``(b, g, p)`` used at CF ``cf`` with ``world_size`` ranks.

        All-gather: ``b = bits_for_cf(cf)``. All-reduce: the wire CF is set by the lanes, not by
        ``b``, so ``b`` is the most precise one whose lanes still deliver the largest wire CF not
        above ``cf`` (b = 4 in uint8 lanes up to 8 ranks; b = 8, int32 lanes, below CF 4).
        """
        if self.bits is not None:
            b = self.bits
        elif self.transport == "allgather":
            b = bits_for_cf(cf)
        else:
            wire = {bits: self._wire_cf(bits, world_size) for bits in VALID_BITS}
            fitting = [bits for bits in VALID_BITS if wire[bits] <= cf] or [max(VALID_BITS)]
            best = max(wire[bits] for bits in fitting)
            b = max(bits for bits in fitting if wire[bits] == best)
        return b, self._granularity(b), self.p if self.p is not None else DEFAULT_P[b]

    def _granularity(self, bits: int) -> int:
        return self.granularity if self.granularity is not None else DEFAULT_GRANULARITY[bits]

    def _wire_cf(self, bits: int, world_size: int) -> float:
        if self.transport == "allreduce":
            width = lane_bits(self._granularity(bits), world_size)
            return REFERENCE_BITS * lanes_per_word(width) / LANE_WORD_BITS
        return REFERENCE_BITS / bits

    def deliverable_cf(self, cf: float, world_size: int = 1) -> float:
        """Wire CF: ``32 / b`` packed (all-gather); for the all-reduce ``32 L / 64`` with
        ``L = floor(64 / w)`` lanes of :func:`lane_bits` ``w`` to an int64 word (the bits an
        element really takes, the word's unused bits included)."""
        b, _, _ = self.config(check_cf(cf), world_size)
        return self._wire_cf(b, world_size)

    def layout(self, numel: int) -> tuple[int, int]:
        """``(block, padded)``: rotation block length and padded length for ``numel`` elements."""
        full = next_power_of_two(numel)
        if self.rotation == "full":
            return full, full
        block = min(1 << self.partial_stages, full)
        return block, -(-numel // block) * block

    def table(self, cf: float) -> tuple[int, ...]:
        """The table ``T_{b,g,p}`` used at CF ``cf``."""
        b, g, p = self.config(cf)
        return optimal_table(b, g, p, symmetric=self.symmetric_table)

    # -- compressor interface ------------------------------------------------------------------

    def local_stats(self, x: Tensor, cf: float, rnd: Round) -> Tensor | None:
        """This rank's L2 norm per rotation block (one value for the full rotation)."""
        if x.numel() == 0:
            return None
        block, padded = self.layout(x.numel())
        return block_norms(x, block, padded)

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[Payload, THCContext]:
        b, g, p = self.config(check_cf(cf), rnd.world_size)
        flat = x.detach().reshape(-1)
        n = flat.numel()
        cd = _compute_dtype(x.dtype)
        device = flat.device
        block, padded = self.layout(n)
        # The table stays on the CPU: the kernels read it on the host and copy what they need.
        table = torch.tensor(optimal_table(b, g, p, symmetric=self.symmetric_table))
        t = clamp_threshold(p)
        sign_seed = derive_seed(self.seed, rnd.step, rnd.key, _DIAGONAL_STREAM)
        round_seed = derive_seed(self.seed, rnd.step, rnd.key, _ROUNDING_STREAM)
        if n == 0:
            norms = torch.zeros(0, dtype=cd, device=device)
            ctx = THCContext(
                x.shape, x.dtype, 0, 1.0, b, g, t, table, norms, sign_seed, device, 1, 0,
                rnd.world_size, 0, round_seed,
            )  # fmt: skip
            return self._empty_payload(g, rnd.world_size, device), ctx
        norms = self._agreed_norms(x, block, padded, rnd)
        width = lane_bits(g, rnd.world_size) if self.transport == "allreduce" else 0
        lane = torch.int32 if width else None
        work = self._cpu_work(flat, block, padded)
        enc = Encoding(g, t, block, padded, sign_seed, round_seed, b)
        if work is not None:
            sent = _encode_cpu(flat, norms, table, work, enc, width=width)
        else:
            sent = thc_payload(flat, norms, table, enc, lane=lane, backend=self.backend)
            if lane is not None:
                sent = pack_lanes(sent, width)
        achieved = self.deliverable_cf(cf, rnd.world_size)
        ctx = THCContext(
            x.shape, x.dtype, n, achieved, b, g, t, table, norms, sign_seed, device, block,
            padded, rnd.world_size, width, round_seed,
        )  # fmt: skip
        payload: Payload
        if lane is not None:
            payload = THCLevelsPayload(
                words=sent, count=torch.ones(1, dtype=torch.int64, device=device)
            )
        else:
            payload = THCPackedPayload(indices=sent)
        return payload, ctx

    def mean_bound(self, ctx: Context, world_size: int, x_bound: float) -> float:
        """``N t sqrt(B) l``, ``l`` the largest agreed norm: a rotated coordinate decodes to at
        most ``N t l / sqrt(B)`` (``N`` ranks' levels, each within the clamp ``t``), and the
        inverse rotation sums ``B`` of them. Independent of ``x``: the scale is agreed."""
        c = cast(THCContext, ctx)
        if c.numel == 0:
            return 0.0
        return world_size * c.clamp * math.sqrt(c.block) * float(c.norms.max())

    def residual_(self, x: Tensor, payload: Payload, ctx: Context) -> Tensor:
        """``x - D(payload)`` in ``x``'s storage, its subnormal entries flushed to zero
        (:func:`~gravac.kernels.subnormal.flush_subnormal_`)."""
        return flush_subnormal_(super().residual_(x, payload, ctx))

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        """The estimate a (possibly all-reduced) payload stands for: the *sum* over its ranks."""
        c = cast(THCContext, ctx)
        if c.numel == 0:
            return torch.zeros(c.shape, dtype=c.dtype, device=c.device)
        if isinstance(payload, THCLevelsPayload):
            return self._decode_lanes(payload.words, payload.count, c)
        if isinstance(payload, THCPackedPayload):
            return self._decode_packed([payload.indices], c)
        raise TypeError(f"thc cannot decompress a {type(payload).__name__}")

    def combine(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None = None
    ) -> Tensor:
        """Sum of the ranks' estimates: levels summed (or looked up and summed), decoded once;
        written into ``out`` when given (as :meth:`Compressor.combine`)."""
        if not payloads:
            raise ValueError("combine() needs at least one payload, got none")
        c = cast(THCContext, ctx)
        if self.transport == "allreduce":
            if len(payloads) > c.world_size:
                raise ValueError(
                    f"{len(payloads)} payloads exceed the world_size {c.world_size} their lanes "
                    "were sized for: the integer sum could overflow"
                )
            return super().combine(payloads, ctx, out)
        if c.numel == 0:
            total = torch.zeros(c.shape, dtype=c.dtype, device=c.device)
        else:
            total = self._decode_packed([cast(THCPackedPayload, p).indices for p in payloads], c)
        return total if out is None else out.copy_(total.reshape(-1)).view(c.shape)

    # -- helpers -------------------------------------------------------------------------------

    def _decode_lanes(self, words: Tensor, count: Tensor, c: THCContext) -> Tensor:
        """Decode summed lanes: the CPU path (:mod:`gravac.compressors.thc.cpu`) where it
        serves, else the reference."""
        work = self._cpu_work(words, c.block, c.padded, dtype=c.dtype)
        if work is None:
            return thc_decode(unpack_lanes(words, c.lane_bits, c.padded), count, c)
        return _decode_lanes_cpu(words, count, c, work)

    def _decode_packed(self, packed: Sequence[Tensor], c: THCContext) -> Tensor:
        """Look up, sum and decode packed indices: the CPU path where it serves, else
        :func:`~gravac.kernels.quantize.unpack_lookup_sum` and the reference."""
        work = self._cpu_work(packed[0], c.block, c.padded, dtype=c.dtype)
        if work is None:
            total = unpack_lookup_sum(packed, c.bits, c.padded, c.table, backend=self.backend)
            return thc_decode(total, len(packed), c)
        return _decode_packed_cpu(packed, c, work)

    def _cpu_work(
        self, x: Tensor, block: int, padded: int, *, dtype: torch.dtype | None = None
    ) -> _CPUWork | None:
        """The reused buffers of the CPU kernels for the layout ``(block, padded)``; None off
        them (not on the CPU, or quantised in float64: ``dtype``, default ``x``'s)."""
        if x.device.type != "cpu" or _compute_dtype(dtype or x.dtype) != torch.float32:
            return None
        work = self._work.get((block, padded))
        if work is None:
            # One layout at a time: a model's buckets differ, but keeping every length's buffers
            # would hold several padded copies of the model.
            self._work = {(block, padded): _CPUWork(padded, block)}
            work = self._work[(block, padded)]
        return work

    def _agreed_norms(self, x: Tensor, block: int, padded: int, rnd: Round) -> Tensor:
        n_blocks = padded // block
        # Never None here: local_stats() is None only for an empty x, handled by compress().
        agreed = cast(Tensor, agreed_stats(self, x, 1.0, rnd)).reshape(-1)
        if agreed.numel() != n_blocks:
            raise ValueError(
                f"rnd.agreed must hold {n_blocks} block norms (local_stats' shape), "
                f"got {agreed.numel()}"
            )
        return agreed.to(device=x.device, dtype=_compute_dtype(x.dtype))

    def _empty_payload(self, granularity: int, world_size: int, device: torch.device) -> Payload:
        if self.transport == "allreduce":
            lane_bits(granularity, world_size)  # raises when no lane holds the sum
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            return THCLevelsPayload(words=empty, count=empty.clone())
        return THCPackedPayload(indices=torch.zeros(0, dtype=torch.uint8, device=device))

    def __repr__(self) -> str:
        return (
            f"THCCompressor(bits={self.bits!r}, granularity={self.granularity!r}, p={self.p!r}, "
            f"rotation={self.rotation!r}, partial_stages={self.partial_stages}, "
            f"transport={self.transport!r}, seed={self.seed}, "
            f"symmetric_table={self.symmetric_table}, backend={self.backend!r})"
        )
