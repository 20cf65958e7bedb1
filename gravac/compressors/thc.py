"""THC: Tensor Homomorphic Compression (Li et al., NSDI 2024; docs/design.md section 10).

Every rank quantises its gradient onto integer levels that can be *summed* by the collective and
decompressed once, after aggregation, so nothing is decompressed and re-compressed in between::

    y = clamp(sqrt(B) / l * RHT(x), -t_p, t_p)                 rotate, normalise, clamp
    u = (y + t_p) * g / (2 t_p)                                 onto [0, g]
    z = SQ_T(u)                                                 index into T_{b,g,p}
    send T[z] (allreduce, integer lanes) or z packed in b bits (allgather)
    sum_i T[z_i]  ->  (S - N g / 2) * 2 t_p / g * l / sqrt(B)  ->  RHT^-1  ->  un-pad

* RHT (THC section 5.1): ``H D x / sqrt(B)`` with ``D`` a Rademacher diagonal hashed from each
  position and :func:`gravac.seeding.derive_seed` of (``seed``, step, key)
  (:func:`gravac.kernels.quantize.hash_signs`): identical on all ranks, fresh every step and
  bucket, drawn inside the CUDA kernel without being stored, and regenerated for decoding.
  ``rotation="full"`` pads the flat input to a power of two ``B = d`` and rotates
  it whole; ``rotation="partial"`` pads to a multiple of ``B = 2^partial_stages`` (capped at the
  input's power-of-two size) and rotates each contiguous block of ``B`` on its own,
  ``I (x) H_B`` (the first ``partial_stages`` butterfly stages of the full transform; see
  :mod:`gravac.kernels.hadamard`): ``partial_stages`` passes over the data instead of
  ``log2 d``.
* Scale: ``l`` is the largest L2 norm over ranks (THC section 5.2: the rotation preserves norms,
  so the exchange needs no transformed data), agreed through :meth:`THCCompressor.local_stats`
  with ``stats_op = "max"``. A rotated coordinate is then about ``N(0, ||x||^2 / B)``. With partial
  rotation every block has its own norm, reduced across ranks block by block: one global scale
  over block-rotated heavy-tailed data leaves most blocks far below the clamp and the table
  (measured on log-normal(0, 2), 2^16 elements, blocks of 2^10: NMSE 0.067 with one global
  max-norm against 0.015 with per-block norms; ``tests/compressors/test_thc.py``).
* Clamp at ``t_p = Phi^-1(1 - p/2)`` (a fraction ``p`` of normal coordinates) and stochastic
  rounding onto the optimal table ``T_{b,g,p}`` (:mod:`gravac.compressors.thc_table`; by default
  the mirror-symmetric optimum, which reproduces THC's published table for (4, 30, 1/32)).
  Rounding is unbiased inside the clamp; the clamp's bias is left to error feedback (the memory
  gets ``D(C(x))`` of this rank's own payload, outside the compressor). Ranks with similar
  gradients clamp alike, so that bias does not average out over ranks: the NMSE of the N-rank
  average falls as 1/N down to about ``clamp_error(p)`` (0.0073 at p = 1/32).
* Transports (``transport``): ``"allreduce"`` sends the levels ``T[z]`` in 0..g packed into
  lanes of ``w = ceil(log2(N g + 1))`` bits (:func:`lane_bits`), ``floor(64 / w)`` lanes to an
  int64 word (:func:`pack_lanes`): gloo and NCCL sum int64 words exactly (two's complement
  wraparound is exact modulo 2^64, and no lane's sum reaches ``2^w``, so no carry crosses a
  lane), plus a one-word ``count`` that sums to the number of contributions, so a summed payload
  decompresses without being told ``N``. ``"allgather"`` sends the ``b``-bit indices packed into
  bytes (``32 / b`` times fewer bytes than float32); :meth:`THCCompressor.combine` unpacks,
  looks up and sums the levels, then decompresses once.

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

CPU speed. On CPU tensors quantised in float32, :meth:`THCCompressor.compress` runs
:func:`_encode_cpu` and ``decompress``/``combine`` run :func:`_decode_cpu`: NumPy/torch passes
over chunks of :data:`_CPU_CHUNK` elements held in buffers the compressor keeps for the last
layout (sign-bit flips for the diagonal, the rotation by Kronecker GEMMs
(:func:`~gravac.kernels.hadamard.fwht_rows`, per chunk when a block fits in one), the reference's
scale-clamp-shift (less its last clamp where that is the identity, as for every default ``(g,
p)``), the rounding by :func:`~gravac.kernels.quantize.round_levels` into the narrowest unsigned
dtype of the levels, without gathers for the two-level and unit tables, and the lanes ORed per
chunk into byte (or wider) planes of the words, interleaved once at the end, instead of widening
every level to 64 bits). The diagonal's hashes are computed once in NumPy uint32
(:func:`~gravac.kernels.quantize.sign_hashes`, which the reference's
:func:`~gravac.kernels.quantize.hash_signs` uses too). Both equal the reference
(:func:`thc_payload` with ``backend="torch"``, :func:`thc_decode`) up to the rotation's
summation order: the payload bit for bit when the rotated values are exact, the decoded sum
within ``2 log2(B) 2^-24`` of its norm (``tests/compressors/test_thc.py``). Why this shape: the
torch reference makes many full-size passes and gathers; chunks that stay in cache and GEMMs
for the rotation make the CPU path many times faster than the reference, and the two 32 x 32
GEMMs of a 2^10 block run near one core's FMA peak. The timings and the profile are in
``docs/studies/2026-11-30-thc-cpu.md``.

Default rotation: ``"partial"`` (blocks of 2^10, per-block max-norms). On ``gravac bench
compressors`` it was no less accurate than the full rotation and faster to compress and
decompress (the full rotation of a large bucket takes more passes over memory), measured in
``docs/studies/2026-11-30-thc-cpu.md``. At b = 4 on one worker the tests bound both below 0.026
(``tests/compressors/test_thc.py``); ``"full"`` remains available.

Defaults per bit width, ``(g, p)``, chosen by the table DP's predicted NMSE of one worker on
normal coordinates (:func:`gravac.compressors.thc_table.expected_nmse`; rounding plus clamping):

====  =====  ========  ==============  ==========================================================
 b     g      p        predicted NMSE  why
====  =====  ========  ==============  ==========================================================
 1     1      1/2      0.455           two levels {0, g}: g does not matter, p = 1/2 is the best
 2     3      1/5      0.177           the uniform table is optimal (g = 6, 12 give the same)
 4     30     1/32     0.0203          THC's defaults (p = 1/64 would give 0.0194)
 8     510    1/16384  0.000093        g = 255 (uniform) gives 0.00016 at its best p
====  =====  ========  ==============  ==========================================================

Randomness of the rounding. Stochastic rounding must be independent across ranks (that is what
makes the error of the N-rank average fall as 1/N) but ``compress`` does not know its rank, and
seeding a generator from the rank would make the simulation (one process) differ from the real
run. The uniforms are therefore a hash of each rounded value's bits, its position and
``derive_seed(seed, step, key)`` (:func:`gravac.kernels.quantize.hash_uniform`): ranks whose
inputs differ round independently, the same input always compresses to the same payload (no
generator state, no host sync), and a step's noise is fresh because the seed includes the step.
The one consequence: ranks whose rotated values are bit-identical (identical inputs, or inputs a
few ulps apart) round identically, so their errors do not average out (the average is then as
accurate as one rank, never worse); a relative difference of 1e-6 already decorrelates them.
The global RNG is not used: ranks usually seed it identically, which would correlate their
rounding for every input.

.. note:: Non-finite input. The local norm is then NaN or Inf, so the agreed max-norm is too
   (when the collective's max propagates NaN, as torch's ``amax`` does; a backend whose max
   drops NaN would hide it in the scale, but the gain, computed from ``x``, is NaN regardless),
   and the decompressed result is non-finite: the gain is NaN and the optimizer skips the step.
   Quantisation itself never sees NaN (a NaN rotated value is mapped to the middle of the
   range, an infinite one to the clamp), so nothing raises.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, cast

import numpy as np
import torch
from torch import Tensor

from gravac.compressors.base import (
    REFERENCE_BITS,
    Collective,
    Compressor,
    Context,
    Payload,
    Round,
    StatsOp,
    check_cf,
)
from gravac.compressors.registry import register
from gravac.compressors.thc_table import VALID_BITS, clamp_threshold, optimal_table
from gravac.kernels import check_backend_name, cupy_thc, resolve_backend
from gravac.kernels.hadamard import fwht, fwht_rows, next_power_of_two
from gravac.kernels.quantize import (
    CellTables,
    RoundingWork,
    check_packed,
    flip_signs,
    hash_signs,
    hash_uniform,
    lookup,
    pack_bits,
    packed_numel,
    round_levels,
    sign_hashes,
    stochastic_quantize,
    table_cells,
    table_intervals,
    unpack_lookup_sum,
)
from gravac.seeding import derive_seed

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_P",
    "DEFAULT_PARTIAL_STAGES",
    "LANE_WORD_BITS",
    "Encoding",
    "THCCompressor",
    "THCContext",
    "THCLevelsPayload",
    "THCPackedPayload",
    "bits_for_cf",
    "block_norms",
    "block_scale",
    "lane_bits",
    "lanes_per_word",
    "pack_lanes",
    "thc_decode",
    "thc_encode",
    "thc_payload",
    "unpack_lanes",
]

#: Granularity g per bit width (module docstring table): levels are integers in 0..g.
DEFAULT_GRANULARITY: dict[int, int] = {1: 1, 2: 3, 4: 30, 8: 510}
#: Clamped fraction p per bit width (module docstring table): clamp at Phi^-1(1 - p/2).
DEFAULT_P: dict[int, float] = {1: 1 / 2, 2: 1 / 5, 4: 1 / 32, 8: 1 / 16384}
#: Butterfly stages of the partial rotation: blocks of 2^10 = 1024 elements, as THC's code.
DEFAULT_PARTIAL_STAGES = 10
#: Largest partial block, 2^30 elements (beyond that, use the full rotation).
_MAX_PARTIAL_STAGES = 30
#: Bits of the all-reduce's integer word, int64: gloo and NCCL both sum int64 exactly (gloo has
#: no unsigned 64-bit sum; int32 words would waste more bits to padding). Lanes may use all 64
#: bits: the top lane's sum can reach the sign bit, and the collectives add two's complement
#: words with wraparound, which is exact modulo 2^64, so every lane (its true sum < 2^width)
#: comes back exactly.
LANE_WORD_BITS = 64
#: Elements per pass of the CPU kernels (:func:`_encode_cpu`, :func:`_decode_cpu`): 2^18
#: float32 (1 MiB) measured fastest at 16M with the current passes (compress 0.10-0.12 s against
#: 0.11-0.13 s at 2^17, 0.13 s at 2^16 and 0.12-0.14 s at 2^20; decode no slower): a chunk's
#: buffers stay in L2/L3 through its ~25 passes, and the per-chunk Python overhead (about 40
#: calls of a few us each, ~0.17 ms a chunk) is amortised over fewer chunks.
_CPU_CHUNK = 1 << 18
Rotation = Literal["full", "partial"]
Transport = Literal["allreduce", "allgather"]
_ROTATIONS: tuple[Rotation, ...] = ("full", "partial")
_TRANSPORTS: tuple[Collective, ...] = ("allreduce", "allgather")
# Stream tags that keep the diagonal's and the rounding's seeds apart for one (seed, step, key).
_DIAGONAL_STREAM = 0x5448435F44494147  # "THC_DIAG"
_BYTE_BITS = 8
#: Device copies of THC tables kept (a few bit widths x lanes x devices).
_TABLE_CACHE = 64
_ROUNDING_STREAM = 0x5448435F524E4447  # "THC_RNDG"


def bits_for_cf(cf: float) -> int:
    """Bits per element for a requested CF: the largest ``32 / b <= cf``; 8 below CF 4."""
    cf = check_cf(cf)
    for bits in sorted(VALID_BITS):
        if REFERENCE_BITS / bits <= cf:
            return bits
    return max(VALID_BITS)


def lane_bits(granularity: int, world_size: int) -> int:
    """Width ``w = ceil(log2(N g + 1))`` of a lane that holds the sum of ``N`` levels in 0..g.

    Raises:
        ValueError: no lane of at most :data:`LANE_WORD_BITS` bits holds ``N g``.
    """
    if granularity < 1 or world_size < 1:
        raise ValueError(
            f"granularity and world_size must be >= 1, got {granularity} and {world_size}"
        )
    width = (granularity * world_size).bit_length()
    if width > LANE_WORD_BITS:
        raise ValueError(
            f"the sum over world_size={world_size} ranks of levels up to granularity="
            f"{granularity} needs {width} bits, more than a {LANE_WORD_BITS}-bit word; use a "
            "smaller granularity (or bits) or the allgather transport"
        )
    return width


def lanes_per_word(width: int) -> int:
    """Lanes of ``width`` bits in one :data:`LANE_WORD_BITS`-bit word."""
    return LANE_WORD_BITS // width


def _word_count(numel: int, width: int) -> int:
    return -(-numel // lanes_per_word(width))


def _lane_runs(start: int, end: int, words: int, width: int) -> Iterator[tuple[int, int, int]]:
    """Elements ``[start, end)`` of :func:`pack_lanes`' planar layout over ``words`` words, split
    by lane: ``(shift, first, stop)``, elements ``first..stop`` sitting at bit ``shift`` of words
    ``first mod words ..``, consecutively."""
    pos = start
    while pos < end:
        lane = pos // words
        stop = min(end, (lane + 1) * words)
        yield lane * width, pos, stop
        pos = stop


def pack_lanes(levels: Tensor, width: int) -> Tensor:
    """Pack 1-D non-negative ``levels`` (each below ``2^width``) into int64 words.

    Planar layout: with ``W = ceil(n / L)`` words of ``L`` lanes, element ``i`` sits in word
    ``i mod W`` at bits ``[(i // W) w, (i // W + 1) w)``, so lane ``k`` of every word is the
    contiguous run ``levels[k W : (k + 1) W]`` (zero-padded at the end). Summing the words of
    several ranks sums every lane, without carries across lanes while each lane's sum stays
    below ``2^width`` (:func:`lane_bits`).
    """
    n = levels.numel()
    words = _word_count(n, width)
    out = torch.zeros(words, dtype=torch.int64, device=levels.device)
    flat = levels.reshape(-1)
    for shift, first, stop in _lane_runs(0, n, words, width):
        word = first % words
        run = torch.bitwise_left_shift(flat[first:stop].long(), shift)
        out[word : word + stop - first].bitwise_or_(run)
    return out


def unpack_lanes(words: Tensor, width: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_lanes` (also of summed words): the first ``numel`` lanes, int64."""
    if words.numel() != _word_count(numel, width):
        raise ValueError(
            f"{numel} lanes of {width} bits pack into {_word_count(numel, width)} words, "
            f"got {words.numel()}"
        )
    out = torch.empty(numel, dtype=torch.int64, device=words.device)
    count, mask = words.numel(), (1 << width) - 1
    for shift, first, stop in _lane_runs(0, numel, count, width):
        word = first % count
        run = out[first:stop]
        torch.bitwise_right_shift(words[word : word + stop - first], shift, out=run)
        run.bitwise_and_(mask)
    return out


@dataclass(frozen=True)
class THCLevelsPayload(Payload):
    """All-reduce transport: table levels packed in lanes of int64 words, and the contributions.

    Attributes:
        words: :func:`pack_lanes` of ``T[z]`` in ``0..g`` per padded element, in lanes of
            :func:`lane_bits` bits (summed: ``0..g * N`` per lane).
        count: one int64 element, 1 per rank (summed: ``N``); empty for an empty input.
    """

    words: Tensor
    count: Tensor


@dataclass(frozen=True)
class THCPackedPayload(Payload):
    """All-gather transport: the ``b``-bit table indices, ``8 / b`` per byte (uint8)."""

    indices: Tensor


@dataclass(frozen=True)
class Encoding:
    """What every rank encodes one THC round with (all agreed or shared).

    Attributes:
        granularity: ``g``, levels are integers in ``0..g``.
        clamp: ``t_p``.
        block: rotation block length ``B`` (the padded length for the full rotation).
        padded: padded length, a multiple of ``block``.
        sign_seed: seed of the Rademacher diagonal.
        round_seed: seed of the rounding hash.
        bits: ``b``, bits per index.
    """

    granularity: int
    clamp: float
    block: int
    padded: int
    sign_seed: int
    round_seed: int
    bits: int


@dataclass(frozen=True)
class THCContext(Context):
    """What the sender keeps to decompress (identical on every rank).

    Attributes:
        bits: ``b``, bits per index.
        granularity: ``g``, levels are integers in ``0..g``.
        clamp: ``t_p``.
        table: the ``2^b`` levels ``T_{b,g,p}`` (int64, on the CPU).
        norms: agreed max-norm per block (float, one per rotated block).
        sign_seed: seed of the Rademacher diagonal (:attr:`signs`).
        device: where the payload lives.
        block: rotation block length ``B`` (the padded length for the full rotation).
        padded: padded length, a multiple of ``block``.
        world_size: ranks the all-reduce lanes were sized for.
        lane_bits: width of the all-reduce's lanes (0 for the all-gather).
        round_seed: seed of the rounding hash (:func:`thc_payload` reproduces the payload).
    """

    bits: int
    granularity: int
    clamp: float
    table: Tensor
    norms: Tensor
    sign_seed: int
    device: torch.device
    block: int
    padded: int
    world_size: int
    lane_bits: int
    round_seed: int

    @property
    def encoding(self) -> Encoding:
        """What the payload was encoded with (:func:`thc_payload` reproduces it)."""
        return Encoding(
            self.granularity, self.clamp, self.block, self.padded, self.sign_seed,
            self.round_seed, self.bits,
        )  # fmt: skip

    @property
    def signs(self) -> Tensor:
        """The Rademacher diagonal over the padded length, in the compute dtype."""
        cd = _compute_dtype(self.dtype)
        return hash_signs(self.padded, self.sign_seed, dtype=cd, device=self.device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other dtype is rotated and quantised in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _padded(flat: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros(length, dtype=dtype, device=flat.device)
    out[: flat.numel()] = flat
    return out


def block_scale(norms: Tensor, block: int) -> Tensor:
    """``sqrt(B) / l`` per block (0 where the norm is 0): rotated values become about N(0, 1)."""
    return torch.where(norms > 0, math.sqrt(block) / norms, torch.zeros_like(norms))


def block_norms(x: Tensor, block: int, padded: int) -> Tensor:
    """L2 norm of every block of ``block`` elements of ``x`` zero-padded to ``padded``.

    Computed in the compute dtype without materialising the padding: the whole blocks as one
    batch, the partial last block on its own, blocks of padding only are 0.
    """
    flat = x.detach().reshape(-1)
    cd = _compute_dtype(x.dtype)
    whole = flat.numel() // block
    out = torch.zeros(padded // block, dtype=cd, device=flat.device)
    if whole:
        out[:whole] = _norms(flat[: whole * block].view(whole, block), cd)
    if flat.numel() > whole * block:
        out[whole] = _norms(flat[whole * block :].view(1, -1), cd)[0]
    return out


def _norms(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """L2 norm of each row in ``dtype``; rows whose squares overflow (a float32 sum of squares
    passes 3.4e38 from elements of about 1e17 up) are recomputed as ``m * ||row / m||`` with
    ``m`` the row's largest magnitude, so finite input always gives a finite norm."""
    norms = torch.linalg.vector_norm(rows, dim=1, dtype=dtype)
    if bool(torch.isinf(norms).any()):
        m = rows.abs().amax(dim=1, keepdim=True).to(dtype)
        safe = torch.where(m > 0, m, torch.ones_like(m))
        norms = torch.linalg.vector_norm(rows.to(dtype) / safe, dim=1).mul_(m[:, 0])
    return norms


def thc_encode(
    x: Tensor,
    norms: Tensor,
    signs: Tensor,
    table: Tensor,
    *,
    granularity: int,
    clamp: float,
    block: int,
    seed: int,
) -> Tensor:
    """THC's compression of one rank's ``x``: int64 table indices over the padded length.

    ``u = (clamp(sqrt(B) / l * H_B (D x), +-t) + t) * g / (2t)``, rounded onto ``table`` with
    uniforms hashed from ``u`` and ``seed`` (module docstring). The torch reference of the fused
    CUDA kernel (:func:`thc_payload`), which must match it bit for bit.
    """
    return _quantize(_rotate(x, signs, block), norms, table, granularity, clamp, block, seed)


def _rotate(x: Tensor, signs: Tensor, block: int) -> Tensor:
    """``H_B D x / sqrt(B)`` per block of ``x`` zero-padded to the length of ``signs``."""
    v = _padded(x.detach().reshape(-1), signs.numel(), signs.dtype).mul_(signs)
    return fwht(v.view(-1, block), backend="torch").reshape(-1)


def _quantize(
    rotated: Tensor, norms: Tensor, table: Tensor, g: int, clamp: float, block: int, seed: int
) -> Tensor:
    y = rotated.view(-1, block).mul_(block_scale(norms, block)[:, None]).reshape(-1)
    y = torch.nan_to_num_(y, nan=0.0).clamp_(-clamp, clamp)
    u = y.add_(clamp).mul_(g / (2.0 * clamp)).clamp_(0.0, float(g))
    uniform = hash_uniform(u, seed, backend="torch")
    return stochastic_quantize(u, table, uniform, backend="torch")


@functools.lru_cache(maxsize=_TABLE_CACHE)
def _device_tables(
    table: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    lane: torch.dtype | None,
    *,
    identity: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The CUDA kernel's tables on ``device``, built once: levels and reciprocal widths in
    ``dtype``, the int32 cell index, and what each index sends in ``lane`` lanes (``T`` itself,
    or the index when ``identity``; ``None`` for no lane: packed output).
    """
    t = torch.tensor(table)
    levels, cells = table_cells(t)
    sent = None
    if lane is not None:
        sent = torch.arange(len(table)) if identity else levels
        sent = sent.to(device=device, dtype=lane)
    values, inv_width = (v.to(device) for v in table_intervals(t, dtype))
    return values, inv_width, cells.to(device, torch.int32), sent


def thc_payload(
    x: Tensor,
    norms: Tensor,
    table: Tensor,
    enc: Encoding,
    *,
    lane: torch.dtype | None,
    backend: str | None = None,
) -> Tensor:
    """The tensor THC sends: ``T[z]`` in ``lane`` lanes, or (``lane=None``) ``z`` packed.

    ``z`` is :func:`thc_encode` of ``x`` with the diagonal ``hash_signs(padded, sign_seed)``.
    On CUDA the CuPy kernel (:mod:`gravac.kernels.cupy_thc`) does it all in one pass for blocks
    up to :data:`~gravac.kernels.cupy_thc.MAX_SHARED_BLOCK`, and after torch's rotation above.
    """
    granularity, clamp, block, padded = enc.granularity, enc.clamp, enc.block, enc.padded
    sign_seed, round_seed, bits = enc.sign_seed, enc.round_seed, enc.bits
    flat = x.detach().reshape(-1)
    cd = _compute_dtype(flat.dtype)
    use = resolve_backend(flat, backend, op="thc", cupy=cupy_thc.supports(flat))
    if use == "torch":
        signs = hash_signs(padded, sign_seed, dtype=cd, device=flat.device)
        idx = thc_encode(
            flat, norms, signs, table, granularity=granularity, clamp=clamp, block=block,
            seed=round_seed,
        )  # fmt: skip
        if lane is not None:
            return lookup(idx, table.to(lane), backend="torch")
        return pack_bits(idx, bits, backend="torch")
    fused_pack = lane is None and block * bits % _BYTE_BITS == 0
    # Unpacked indices: the identity table in uint8 lanes, packed afterwards.
    send = lane if lane is not None or fused_pack else torch.uint8
    levels, inv_width, cells, lane_table = _device_tables(
        tuple(int(v) for v in table.tolist()), flat.device, cd, send, identity=lane is None
    )
    rotated = block > cupy_thc.MAX_SHARED_BLOCK
    if rotated:
        flat = _rotate(flat, hash_signs(padded, sign_seed, dtype=cd, device=flat.device), block)
    out = cupy_thc.thc_encode(
        flat, block_scale(norms, block), levels, inv_width, cells, lane_table,
        bounds=(int(table[0]), int(table[-1])), block=block, padded=padded,
        clamp=clamp, granularity=granularity, sign_seed=sign_seed, round_seed=round_seed,
        bits=bits, rotated=rotated,
    )  # fmt: skip
    if lane is None and not fused_pack:
        return pack_bits(out, bits, backend="torch")
    return out


def _cpu_fast(x: Tensor) -> bool:
    """Whether :func:`_encode_cpu` and :func:`_decode_cpu` serve ``x``: a CPU tensor quantised
    in float32."""
    return x.device.type == "cpu" and _compute_dtype(x.dtype) == torch.float32


class _CPUWork:
    """Buffers of :func:`_encode_cpu` and :func:`_decode_cpu` for one ``(padded, block)`` layout,
    reused across calls (float32, CPU, NumPy arrays with torch views of the same memory).

    ``chunk`` elements are processed at a time (a multiple of the block when the block fits in
    one, so that a chunk is rotated on its own: *fused*); ``values`` holds the chunk's values
    (or, unfused, the whole padded vector, rotated at once), ``spare`` is the transform's other
    buffer (both also as the torch tensors ``values_t``, ``spare_t``), ``lanes`` the decoder's
    chunk of lanes in uint64 words, ``rounding`` the scratch of
    :func:`~gravac.kernels.quantize.round_levels`; :meth:`levels` gives the chunk's rounded
    levels and the scratch of a lane piece in a level dtype.
    """

    def __init__(self, padded: int, block: int) -> None:
        self.chunk = min(padded, _CPU_CHUNK)
        self.fused = block <= self.chunk
        held = self.chunk if self.fused else padded
        self.values = np.empty(held, dtype=np.float32)
        self.spare = np.empty(held, dtype=np.float32)
        self.values_t = torch.from_numpy(self.values)
        self.spare_t = torch.from_numpy(self.spare)
        self.lanes = np.empty(self.chunk, dtype=np.uint64)
        self.rounding = RoundingWork(self.chunk)
        self._levels: dict[np.dtype, tuple[np.ndarray, np.ndarray]] = {}

    def levels(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """``(levels, piece)``: two chunk-long buffers of ``dtype`` (kept per dtype)."""
        if dtype not in self._levels:
            self._levels[dtype] = (np.empty(self.chunk, dtype), np.empty(self.chunk, dtype))
        return self._levels[dtype]


@functools.lru_cache(maxsize=_TABLE_CACHE)
def _cell_tables(table: tuple[int, ...], *, indices: bool) -> CellTables:
    return CellTables.build(torch.tensor(table), indices=indices)


def _chunks(padded: int, chunk: int) -> Iterator[tuple[int, int]]:
    return ((start, min(start + chunk, padded)) for start in range(0, padded, chunk))


def _load_signed(
    xn: np.ndarray, words: np.ndarray, start: int, dst: np.ndarray, work: _CPUWork
) -> None:
    """``dst = (D x)[start : start + len(dst)]`` of ``x`` zero-padded (``len(dst)`` at most a
    chunk)."""
    held = max(min(dst.size, xn.size - start), 0)
    if held:
        flip_signs(
            xn[start : start + held], words, offset=start, out=dst[:held], work=work.rounding
        )
    dst[held:] = 0.0


def _encode_cpu(
    x: Tensor, norms: Tensor, table: Tensor, work: _CPUWork, enc: Encoding, *, width: int
) -> Tensor:
    """:func:`thc_payload` on the CPU in float32, chunk by chunk in ``work``'s buffers: the int64
    words of :func:`pack_lanes` (``width`` > 0) or the packed ``bits``-bit indices.

    Per chunk, while it is in cache: the diagonal by sign-bit flips
    (:func:`~gravac.kernels.quantize.flip_signs`), the rotation of its blocks
    (:func:`~gravac.kernels.hadamard.fwht_rows`; the whole padded vector at once, before the
    chunks, when a block is longer than a chunk), the scale-clamp-shift of :func:`_quantize`
    with the same operations in the same order (less the last clamp where it provably changes
    nothing, :func:`_top_clamp_needed`), the rounding
    (:func:`~gravac.kernels.quantize.round_levels`, bit-identical to the reference) and the
    packing of the chunk (lanes by :func:`_or_lanes`). Only the rotation sums in another order
    than the reference butterflies, so the payload is the reference's bit for bit wherever the
    rotated values are (e.g. small integers with ``log2 B`` even: every partial sum exact).
    """
    granularity, clamp, block, padded = enc.granularity, enc.clamp, enc.block, enc.padded
    xn = x.detach().reshape(-1).to(torch.float32).numpy()
    words = sign_hashes(padded, enc.sign_seed)
    scale = block_scale(norms, block)
    alpha = granularity / (2.0 * clamp)
    top_clamp = _top_clamp_needed(clamp, alpha, granularity)
    cells = _cell_tables(tuple(int(t) for t in table.tolist()), indices=width == 0)
    level_buf, piece = work.levels(cells.level.dtype)
    top = int(cells.level.max())
    # The lanes' planes (width > 0), else the packed bytes.
    if width:
        out = _lane_planes(_word_count(padded, width), cells.level.dtype)
    else:
        out = np.zeros(packed_numel(padded, enc.bits), dtype=np.uint8)
    if not work.fused:
        for start, end in _chunks(padded, work.chunk):
            _load_signed(xn, words, start, work.values[start:end], work)
        whole = work.values_t.view(-1, block)
        fwht_rows(whole, out=whole, work=work.spare_t.view(-1, block))
    for start, end in _chunks(padded, work.chunk):
        n = end - start
        if work.fused:
            values, v = work.values[:n], work.values_t[:n]
            _load_signed(xn, words, start, values, work)
            rows = v.view(-1, block)
            fwht_rows(rows, out=rows, work=work.spare_t[:n].view_as(rows))
            rows.mul_(scale[start // block : end // block, None])
        else:
            values, v = work.values[start:end], work.values_t[start:end]
            v.mul_(scale[start // block])
        torch.nan_to_num_(v, nan=0.0).clamp_(-clamp, clamp)
        v.add_(clamp).mul_(alpha)
        if top_clamp:
            v.clamp_(0.0, float(granularity))
        levels = round_levels(
            values, cells, enc.round_seed, offset=start, out=level_buf[:n], work=work.rounding
        )
        if width:
            _or_lanes(out, levels, start, width, top, piece[:n])
        else:
            chunk_bytes = pack_bits(torch.from_numpy(levels), enc.bits, backend="torch").numpy()
            first = start // (_BYTE_BITS // enc.bits)
            out[first : first + chunk_bytes.size] = chunk_bytes
    return torch.from_numpy(_planes_to_words(out) if width else out)


def _top_clamp_needed(clamp: float, alpha: float, granularity: int) -> bool:
    """Whether :func:`_quantize`'s last clamp to ``[0, g]`` can change a value in float32.

    Its input is ``fl(fl(y + t) * alpha)`` with ``y`` already clamped to ``[-t, t]``: ``y + t``
    lies in ``[+0, 2t]`` (a sum is ``-0`` only when both terms are), and rounding is monotonic,
    so every value lies in ``[+0, fl(2t * alpha)]`` and the clamp is the identity unless
    ``fl(2t * alpha) > g`` (the defaults give exactly ``g`` or one ulp below).
    """
    t32 = np.float32(clamp)
    return bool((t32 + t32) * np.float32(alpha) > granularity)


def _lane_planes(words: int, dtype: np.dtype) -> np.ndarray:
    """Zeroed planes of ``words`` :data:`LANE_WORD_BITS`-bit words in ``dtype`` pieces: row
    ``j`` holds bits ``[j s, (j + 1) s)`` of every word (``s`` the dtype's bits)."""
    return np.zeros((LANE_WORD_BITS // (8 * dtype.itemsize), words), dtype=dtype)


def _or_lanes(
    planes: np.ndarray, levels: np.ndarray, start: int, width: int, top: int, piece: np.ndarray
) -> None:
    """OR elements ``start ..`` (``levels``, below ``top + 1``) into their :func:`pack_lanes`
    lanes, held in :func:`_lane_planes`' ``planes`` of the levels' dtype.

    A level at bit ``s`` of its word covers bits ``[s, s + k)`` (``k`` = bit length of
    ``top``), so it reaches plane ``j`` (bits ``[j P, (j + 1) P)``) as ``level * 2^(s - jP)``
    mod ``2^P`` when ``s >= jP``, else ``level >> (jP - s)``: one multiply (none when ``s = jP``)
    and one OR per plane in the narrow dtype, instead of widening every level to 64 bits.
    """
    piece_bits = 8 * planes.dtype.itemsize
    kind = planes.dtype.type
    words = planes.shape[1]
    for shift, first, stop in _lane_runs(start, start + levels.size, words, width):
        word = first % words
        seg = levels[first - start : stop - start]
        for plane in range(shift // piece_bits, (shift + top.bit_length() - 1) // piece_bits + 1):
            low = plane * piece_bits
            part = seg
            if shift > low:
                part = np.multiply(seg, kind(1 << (shift - low)), out=piece[: seg.size])
            elif shift < low:
                part = np.right_shift(seg, kind(low - shift), out=piece[: seg.size])
            dst = planes[plane, word : word + seg.size]
            np.bitwise_or(dst, part, out=dst)


def _planes_to_words(planes: np.ndarray) -> np.ndarray:
    """The int64 words of :func:`_lane_planes`' ``planes`` (plane ``j`` is the ``j``-th piece
    of a little-endian word)."""
    count = planes.shape[0]
    words = np.empty(planes.size, dtype=planes.dtype.newbyteorder("<"))
    for j, plane in enumerate(planes):
        # One strided copy a plane: 2 ms at 16M against 4 ms for the transposed copy.
        words[j::count] = plane
    return words.view("<i8").astype(np.int64, copy=False)


def _decode_cpu(
    fill: Callable[[int, np.ndarray], None], offset: Tensor, ctx: THCContext, work: _CPUWork
) -> Tensor:
    """:func:`thc_decode` on the CPU in float32, chunk by chunk in ``work``'s buffers.

    ``fill(start, dst)`` writes the level sums of elements ``[start, start + len(dst))`` into
    ``dst`` (float32: exact, sums stay below 2^24); ``offset`` is ``count * g / 2`` (float32).
    Per chunk: the same affine map as :func:`thc_decode`, in the same order, then the inverse
    rotation (:func:`~gravac.kernels.hadamard.fwht_rows`, of the whole vector before the sign
    pass when a block is longer than a chunk) and the diagonal by sign-bit flips, written
    straight into the un-padded float32 result.
    """
    block, padded, n = ctx.block, ctx.padded, ctx.numel
    words = sign_hashes(padded, ctx.sign_seed)
    step = 2.0 * ctx.clamp / ctx.granularity
    scale = ctx.norms / math.sqrt(block)
    result = np.empty(n, dtype=np.float32)

    def affine(start: int, values: np.ndarray) -> None:
        fill(start, values)
        v = torch.from_numpy(values)
        v.sub_(offset).mul_(step)
        v.view(-1, min(block, values.size)).mul_(
            scale[start // block : -(-(start + values.size) // block), None]
        )

    for start, end in _chunks(padded, work.chunk):
        if work.fused:
            values = work.values[: end - start]
            affine(start, values)
            rows = torch.from_numpy(values).view(-1, block)
            fwht_rows(
                rows, out=rows, work=torch.from_numpy(work.spare[: values.size]).view_as(rows)
            )
            _store_signed(values, words, start, result, work)
        else:
            affine(start, work.values[start:end])
    if not work.fused:
        whole = torch.from_numpy(work.values).view(-1, block)
        fwht_rows(whole, out=whole, work=torch.from_numpy(work.spare).view(-1, block))
        for start, end in _chunks(padded, work.chunk):
            _store_signed(work.values[start:end], words, start, result, work)
    return torch.from_numpy(result).to(ctx.dtype).view(ctx.shape)


def _store_signed(
    values: np.ndarray, words: np.ndarray, start: int, result: np.ndarray, work: _CPUWork
) -> None:
    """``result[start : ...] = (D v)`` for the chunk ``values`` at ``start``, cut at the
    result's (un-padded) end."""
    held = max(min(values.size, result.size - start), 0)
    if held:
        dst = result[start : start + held]
        flip_signs(values[:held], words, offset=start, out=dst, work=work.rounding)


def _level_offset(count: Tensor | int, ctx: THCContext) -> Tensor:
    """``count * g / 2`` in the compute dtype: what ``count`` ranks' levels sum to at zero."""
    cd = _compute_dtype(ctx.dtype)
    if isinstance(count, Tensor):
        return count.to(cd) * (ctx.granularity / 2.0)
    return torch.tensor(count * ctx.granularity / 2.0, dtype=cd)


def thc_decode(level_sum: Tensor, count: Tensor | int, ctx: THCContext) -> Tensor:
    """Sum of the ``count`` ranks' estimates from the sum of their levels ``level_sum``.

    ``y = (S - count * g / 2) * 2t / g`` per block, ``* l / sqrt(B)``, inverse rotation (``D H_B``:
    the transform is its own inverse), un-pad, reshape, cast to ``ctx.dtype``.
    """
    cd = _compute_dtype(ctx.dtype)
    signs = ctx.signs
    g, t = ctx.granularity, ctx.clamp
    y = level_sum.to(cd).sub_(_level_offset(count, ctx).to(level_sum.device))
    y.mul_(2.0 * t / g)
    r = y.view(-1, ctx.block).mul_((ctx.norms / math.sqrt(ctx.block))[:, None])
    v = fwht(r).reshape(-1).mul_(signs)
    return v[: ctx.numel].to(ctx.dtype).view(ctx.shape)


@register
class THCCompressor(Compressor):
    """Tensor Homomorphic Compression (module docstring).

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
    stats_op: ClassVar[StatsOp] = "max"

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
        """Decode summed lanes: :func:`_decode_cpu` on the CPU kernel, else the reference."""
        work = self._cpu_work(words, c.block, c.padded, dtype=c.dtype)
        if work is None:
            return thc_decode(unpack_lanes(words, c.lane_bits, c.padded), count, c)
        if words.numel() != _word_count(c.padded, c.lane_bits):
            raise ValueError(
                f"{c.padded} lanes of {c.lane_bits} bits pack into "
                f"{_word_count(c.padded, c.lane_bits)} words, got {words.numel()}"
            )
        summed = words.numpy().view(np.uint64)
        mask = (1 << c.lane_bits) - 1

        def fill(start: int, dst: np.ndarray) -> None:
            for shift, first, stop in _lane_runs(start, start + dst.size, summed.size, c.lane_bits):
                word = first % summed.size
                run = work.lanes[: stop - first]
                np.right_shift(summed[word : word + run.size], shift, out=run)
                np.bitwise_and(run, mask, out=run)
                np.copyto(dst[first - start : stop - start], run, casting="unsafe")

        return _decode_cpu(fill, _level_offset(count, c), c, work)

    def _decode_packed(self, packed: Sequence[Tensor], c: THCContext) -> Tensor:
        """Look up, sum and decode packed indices: :func:`_decode_cpu` on the CPU kernel, else
        :func:`~gravac.kernels.quantize.unpack_lookup_sum` and the reference."""
        work = self._cpu_work(packed[0], c.block, c.padded, dtype=c.dtype)
        if work is None:
            total = unpack_lookup_sum(packed, c.bits, c.padded, c.table, backend=self.backend)
            return thc_decode(total, len(packed), c)
        check_packed(packed, c.bits, c.padded)
        per_byte = _BYTE_BITS // c.bits
        shifts = np.arange(0, _BYTE_BITS, c.bits, dtype=np.uint8)
        levels = c.table.numpy().astype(np.float32)
        arrays = [p.numpy() for p in packed]

        def fill(start: int, dst: np.ndarray) -> None:
            first = start // per_byte
            for i, payload in enumerate(arrays):
                seg = payload[first : first + -(-dst.size // per_byte)]
                fields = ((seg[:, None] >> shifts) & ((1 << c.bits) - 1)).reshape(-1)[: dst.size]
                if i == 0:
                    np.take(levels, fields, out=dst)
                else:
                    dst += np.take(levels, fields)

        return _decode_cpu(fill, _level_offset(torch.tensor([len(packed)]), c), c, work)

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
        agreed = cast(Tensor, self.agreed_stats(x, 1.0, rnd)).reshape(-1)
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
