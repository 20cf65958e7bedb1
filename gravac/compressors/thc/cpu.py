"""THC's vectorised CPU path: the encoder and decoder for CPU tensors quantised in float32.

On CPU tensors quantised in float32 the compressor's ``compress`` runs :func:`_encode_cpu` and
its ``decompress``/``combine`` run :func:`_decode_cpu` (through :func:`_decode_lanes_cpu` and
:func:`_decode_packed_cpu`): NumPy/torch passes over chunks of :data:`_CPU_CHUNK` elements
held in buffers the compressor keeps for the last layout (:class:`_CPUWork`), because the
reference's butterflies, gathers and 64-bit lanes are an order of magnitude slower on a CPU (the
measurements are in docs/studies/2026-11-30-thc-cpu.md). Per chunk, while it is in cache:
sign-bit flips for the diagonal, the rotation by Kronecker GEMMs
(:func:`~gravac.kernels.hadamard.fwht_rows`, per chunk when a block fits in one) of the values
in units of each block's norm, negligible entries zeroed (:data:`_NEGLIGIBLE_UNITS`), the
reference's scale-clamp-shift (less its last clamp where that is the identity, as for every
default ``(g, p)``: :func:`_top_clamp_needed`), the rounding by
:func:`~gravac.kernels.quantize.round_levels` into the narrowest unsigned dtype of the levels,
without gathers for the two-level and unit tables, and the lanes ORed per chunk into byte (or
wider) planes of the words, interleaved once at the end, instead of widening every level to 64
bits. The diagonal's hashes are computed once in NumPy uint32
(:func:`~gravac.kernels.quantize.sign_hashes`, which the reference's
:func:`~gravac.kernels.quantize.hash_signs` uses too).

Both equal the reference (:func:`~gravac.compressors.thc.encoding.thc_payload` with
``backend="torch"``, :func:`~gravac.compressors.thc.encoding.thc_decode`) up to the rotation's
summation order and the negligible entries zeroed: the payload bit for bit when the rotated
values are exact and no entry is below ``2^-64`` of its block's norm, the decoded sum within
``2 log2(B) 2^-24`` of its norm (``tests/compressors/thc/test_cpu.py``). Neither passes a
subnormal value through the rotation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from gravac.compressors.thc.encoding import _BYTE_BITS, _TABLE_CACHE, _level_offset, block_scale
from gravac.compressors.thc.lanes import LANE_WORD_BITS, _lane_runs, _word_count
from gravac.compressors.thc.records import Encoding, THCContext
from gravac.kernels.hadamard import fwht_rows
from gravac.kernels.quantize import (
    CellTables,
    RoundingWork,
    check_packed,
    flip_signs,
    pack_bits,
    packed_numel,
    round_levels,
    sign_hashes,
)

# Private to the package: the compressor reaches the CPU path through these.
__all__: list[str] = []

#: Elements per pass of the CPU kernels (:func:`_encode_cpu`, :func:`_decode_cpu`): 2^18
#: float32 (1 MiB) measured fastest at 16M with the current passes (compress 0.10-0.12 s against
#: 0.11-0.13 s at 2^17, 0.13 s at 2^16 and 0.12-0.14 s at 2^20; decode no slower): a chunk's
#: buffers stay in L2/L3 through its ~25 passes, and the per-chunk Python overhead (about 40
#: calls of a few us each, ~0.17 ms a chunk) is amortised over fewer chunks.
_CPU_CHUNK = 1 << 18

#: The rotation's GEMMs run an x86 core's slow path on subnormal operands and results, and
#: under error feedback a block of zero gradients keeps a residual that shrinks by THC's
#: relative error every step, into that range (docs/studies/2026-12-06-subnormals.md). So
#: each block is rotated in units of its agreed norm's binade (:func:`_binades`, exact powers
#: of two) and entries below this many units are zeroed first (a change of under 2^-63 of the
#: block's norm, far below the quantisation's step). Values of 0 or at least ``2^-64`` are
#: multiples of the float32 ulp at ``2^-64``, ``2^-87``; the Hadamard factors' sums of them stay
#: multiples (0 or at least ``2^-87``); the normalisation ``B^(-1/2) >= 2^-16`` (``B <= 2^32``)
#: leaves its products at least ``2^-103``, whose ulps, and so every sum of them, are
#: multiples of ``2^-126``: no subnormal anywhere in the rotation.
_NEGLIGIBLE_UNITS = 2.0**-64

#: The exponents of :func:`_binades`' units: normal float32 powers of two, as are their
#: reciprocals.
_UNIT_EXPONENTS = (-126, 126)
#: float32's exponent bias and mantissa width: ``2^k`` has the bits ``(k + 127) << 23``.
_FLOAT32_BIAS = 127
_FLOAT32_MANTISSA_BITS = 23


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


def _binades(norms: Tensor) -> Tensor:
    """Per block the unit ``2^(e - 1)``, ``e`` the exponent of its norm ``l = m 2^e``
    (``m`` in ``[1/2, 1)``, :func:`torch.frexp`), so that ``l`` lies in ``[1, 2)`` units; the
    exponent kept within :data:`_UNIT_EXPONENTS`; 1 where ``l`` is 0 or not finite.

    Scaling by a unit or its reciprocal is exact (barring underflow) and commutes with the
    rotation's rounding: ``fl(R(x / u) (s u)) = fl(R(x) s)``, so the payload is unchanged.
    """
    low, high = _UNIT_EXPONENTS
    _, exponent = torch.frexp(norms.to(torch.float32))
    # 2^k built from its bits (biased exponent k + 127, zero mantissa): exact, one pass
    biased = (exponent - 1).clamp(low, high).add_(_FLOAT32_BIAS).to(torch.int32)
    units = biased.bitwise_left_shift_(_FLOAT32_MANTISSA_BITS).view(torch.float32)
    return torch.where(torch.isfinite(norms) & (norms > 0), units, torch.ones_like(units))


def _rotate_in_units(rows: Tensor, per_unit: Tensor, spare: Tensor) -> None:
    """``rows`` (blocks of values) divided by their units (``per_unit``, a column of
    reciprocal units), entries below :data:`_NEGLIGIBLE_UNITS` zeroed (one pass of
    :func:`torch.hardshrink`, NaN and Inf kept) and rotated in place (``spare``: scratch of
    their shape)."""
    rows.mul_(per_unit)
    torch.hardshrink(rows, _NEGLIGIBLE_UNITS, out=rows)
    fwht_rows(rows, out=rows, work=spare)


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
    """:func:`.thc_payload` on the CPU in float32, chunk by chunk in ``work``'s buffers: the int64
    words of :func:`.pack_lanes` (``width`` > 0) or the packed ``bits``-bit indices.

    Per chunk, while it is in cache: the diagonal by sign-bit flips
    (:func:`~gravac.kernels.quantize.flip_signs`), the rotation of its blocks
    (:func:`~gravac.kernels.hadamard.fwht_rows`; the whole padded vector at once, before the
    chunks, when a block is longer than a chunk), the scale-clamp-shift of :func:`._quantize`
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
    units = _binades(norms)
    per_unit = units.reciprocal()[:, None]
    # sqrt(B) / l in units, fl(sqrt(B) / l) u exactly, where that is finite
    scale = block_scale(norms.to(torch.float32) / units, block)
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
        _rotate_in_units(work.values_t.view(-1, block), per_unit, work.spare_t.view(-1, block))
    for start, end in _chunks(padded, work.chunk):
        n = end - start
        if work.fused:
            values, v = work.values[:n], work.values_t[:n]
            _load_signed(xn, words, start, values, work)
            rows = v.view(-1, block)
            blocks = slice(start // block, end // block)
            _rotate_in_units(rows, per_unit[blocks], work.spare_t[:n].view_as(rows))
            rows.mul_(scale[blocks, None])
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
    """Whether :func:`._quantize`'s last clamp to ``[0, g]`` can change a value in float32.

    Its input is ``fl(fl(y + t) * alpha)`` with ``y`` already clamped to ``[-t, t]``: ``y + t``
    lies in ``[+0, 2t]`` (a sum is ``-0`` only when both terms are), and rounding is monotonic,
    so every value lies in ``[+0, fl(2t * alpha)]`` and the clamp is the identity unless
    ``fl(2t * alpha) > g`` (the defaults give exactly ``g`` or one ulp below).
    """
    t32 = np.float32(clamp)
    return bool((t32 + t32) * np.float32(alpha) > granularity)


def _lane_planes(words: int, dtype: np.dtype) -> np.ndarray:
    """Zeroed planes of ``words`` :data:`.LANE_WORD_BITS`-bit words in ``dtype`` pieces: row
    ``j`` holds bits ``[j s, (j + 1) s)`` of every word (``s`` the dtype's bits)."""
    return np.zeros((LANE_WORD_BITS // (8 * dtype.itemsize), words), dtype=dtype)


def _or_lanes(
    planes: np.ndarray, levels: np.ndarray, start: int, width: int, top: int, piece: np.ndarray
) -> None:
    """OR elements ``start ..`` (``levels``, below ``top + 1``) into their :func:`.pack_lanes`
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
    """:func:`.thc_decode` on the CPU in float32, chunk by chunk in ``work``'s buffers.

    ``fill(start, dst)`` writes the level sums of elements ``[start, start + len(dst))`` into
    ``dst`` (float32: exact, sums stay below 2^24); ``offset`` is ``count * g / 2`` (float32).
    Per chunk: the same affine map as :func:`.thc_decode`, in the same order but in units of
    each block's norm (:func:`_binades`: the scale ``l / sqrt(B)`` divided by the unit, exactly),
    then the inverse rotation (:func:`~gravac.kernels.hadamard.fwht_rows`, of the whole vector
    before the sign pass when a block is longer than a chunk), the product by the units, and
    the diagonal by sign-bit flips, written straight into the un-padded float32 result. In
    units, every value rotated is 0 or at least half a level's step times ``B^(-1/2)`` (above
    ``2^-23`` for the default tables and ``B <= 2^32``), far from float32's subnormals.
    """
    block, padded, n = ctx.block, ctx.padded, ctx.numel
    words = sign_hashes(padded, ctx.sign_seed)
    step = 2.0 * ctx.clamp / ctx.granularity
    units = _binades(ctx.norms)
    # l / sqrt(B) in units, fl(l / sqrt(B)) / u exactly, where that is normal
    scale = ctx.norms.to(torch.float32).div(units).div_(math.sqrt(block))
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
            rows = work.values_t[: values.size].view(-1, block)
            fwht_rows(rows, out=rows, work=work.spare_t[: values.size].view_as(rows))
            rows.mul_(units[start // block : end // block, None])
            _store_signed(values, words, start, result, work)
        else:
            affine(start, work.values[start:end])
    if not work.fused:
        whole = work.values_t.view(-1, block)
        fwht_rows(whole, out=whole, work=work.spare_t.view(-1, block))
        whole.mul_(units[:, None])
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


def _decode_lanes_cpu(words: Tensor, count: Tensor, ctx: THCContext, work: _CPUWork) -> Tensor:
    """:func:`_decode_cpu` of summed :func:`.pack_lanes` words
    (``count`` contributions), each chunk's lanes shifted and masked out of the uint64 words."""
    if words.numel() != _word_count(ctx.padded, ctx.lane_bits):
        raise ValueError(
            f"{ctx.padded} lanes of {ctx.lane_bits} bits pack into "
            f"{_word_count(ctx.padded, ctx.lane_bits)} words, got {words.numel()}"
        )
    summed = words.numpy().view(np.uint64)
    mask = (1 << ctx.lane_bits) - 1

    def fill(start: int, dst: np.ndarray) -> None:
        for shift, first, stop in _lane_runs(start, start + dst.size, summed.size, ctx.lane_bits):
            word = first % summed.size
            run = work.lanes[: stop - first]
            np.right_shift(summed[word : word + run.size], shift, out=run)
            np.bitwise_and(run, mask, out=run)
            np.copyto(dst[first - start : stop - start], run, casting="unsafe")

    return _decode_cpu(fill, _level_offset(count, ctx), ctx, work)


def _decode_packed_cpu(packed: Sequence[Tensor], ctx: THCContext, work: _CPUWork) -> Tensor:
    """:func:`_decode_cpu` of the ranks' packed ``b``-bit indices: each chunk's fields unpacked,
    looked up in the table and summed over the ranks."""
    check_packed(packed, ctx.bits, ctx.padded)
    per_byte = _BYTE_BITS // ctx.bits
    shifts = np.arange(0, _BYTE_BITS, ctx.bits, dtype=np.uint8)
    levels = ctx.table.numpy().astype(np.float32)
    arrays = [p.numpy() for p in packed]

    def fill(start: int, dst: np.ndarray) -> None:
        first = start // per_byte
        for i, payload in enumerate(arrays):
            seg = payload[first : first + -(-dst.size // per_byte)]
            fields = ((seg[:, None] >> shifts) & ((1 << ctx.bits) - 1)).reshape(-1)[: dst.size]
            if i == 0:
                np.take(levels, fields, out=dst)
            else:
                dst += np.take(levels, fields)

    return _decode_cpu(fill, _level_offset(torch.tensor([len(packed)]), ctx), ctx, work)
