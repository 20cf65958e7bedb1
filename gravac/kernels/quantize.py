"""Stochastic quantisation onto an integer table, table lookup, bit packing, hashed uniforms.

* :func:`stochastic_quantize`: a value ``x`` between adjacent table levels ``a < c`` rounds up to
  ``c`` with probability ``(x - a) / (c - a)`` and down to ``a`` otherwise, so
  ``E[T[index]] = x`` (unbiased stochastic rounding, THC, Li et al., NSDI 2024, section 4) with
  variance ``(c - x)(x - a)``. Returns table *indices*. Because the levels are integers, the
  interval holding ``x`` is found with one gather from a per-integer-cell index (``floor(x)`` ->
  lower level), not a binary search.
* :func:`lookup`: indices -> levels.
* :func:`pack_bits` / :func:`unpack_bits`: ``b``-bit indices (``b`` in 1, 2, 4, 8), ``8 / b`` per
  byte, the first element in the lowest bits (little-endian within the byte).
* :func:`unpack_lookup_sum`: the receiver's side of packed payloads, ``sum_r T[unpack(p_r)]``.
* :func:`hash_signs`: a Rademacher (+-1) vector hashed from each position and a seed, the same
  on every rank and device (THC's random diagonal).
* :func:`hash_uniform`: per-element uniforms in ``[0, 1)`` that are a hash of each element's bits,
  its position and a 64-bit seed: deterministic for equal inputs, independent across different
  inputs, without a generator, a host sync or a per-rank seed (see
  :mod:`gravac.compressors.thc.encoding` for why the rounding noise is drawn this way).

* :func:`round_levels` and :func:`flip_signs`: the CPU kernels of THC's chunked compression and
  decompression (NumPy uint32 arithmetic on reused buffers), bit-identical to the references
  above (``lookup(stochastic_quantize(u, T, hash_uniform(u, seed)))`` and ``x * hash_signs``);
  :func:`sign_hashes`: the diagonal's 32-bit hashes in NumPy, which both use.

Vectorised torch on any device. On CUDA tensors THC's CuPy kernel (``cuda/thc.cu``) fuses
quantisation, hashing, lookup and packing into its compression, and :func:`unpack_lookup_sum` has a
CuPy kernel of its own; the other functions have none, so ``backend="cupy"`` raises for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from gravac.kernels import cupy_thc
from gravac.kernels.backend import resolve_backend

__all__ = [
    "PACK_BITS",
    "CellTables",
    "RoundingWork",
    "TableSpacing",
    "check_packed",
    "flip_signs",
    "hash_sign_words",
    "hash_signs",
    "hash_uniform",
    "lookup",
    "pack_bits",
    "packed_numel",
    "round_levels",
    "sign_hashes",
    "stochastic_quantize",
    "table_cells",
    "table_intervals",
    "unpack_bits",
    "unpack_lookup_sum",
]

#: Index widths that pack whole bytes.
PACK_BITS = (1, 2, 4, 8)
_BYTE_BITS = 8

# 32-bit hashing in int64 lanes: every product stays below 2^63 (a value < 2^32 times a constant
# of magnitude < 2^31), so nothing overflows and the low 32 bits are exact.
_MASK32 = 0xFFFFFFFF
# "lowbias32" finaliser (C. Wellons, hash-prospector): xorshift-multiply rounds with good
# avalanche. Its second multiplier 0x846CA68B is used as the congruent negative value below 2^31.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
# 2^32 / golden ratio, negated mod 2^32 (below 2^31): spreads consecutive positions.
_POSITION_MUL = 0x61C88647
#: Uniforms take the top 24 bits of the hash: exactly representable in float32.
_UNIFORM_BITS = 24
#: Shift of the uniform hash's xorshift step (lowbias32's first).
_XORSHIFT = 16
#: Shift that spreads an int32's sign bit over the word (-1 when negative, else 0).
_SIGN_SHIFT = 31
#: Rademacher signs drawn from one 32-bit hash.
_SIGNS_PER_HASH = 32
#: Levels of a one-bit table, ``{0, g}``: :func:`round_levels` rounds it without a gather.
_TWO_LEVELS = 2


def _check_table(table: Tensor) -> None:
    if table.dim() != 1 or table.numel() < 2:
        raise ValueError(f"table must be 1-D with >= 2 levels, got shape {tuple(table.shape)}")


def stochastic_quantize(
    x: Tensor, table: Tensor, uniform: Tensor, *, backend: str | None = None
) -> Tensor:
    """Unbiased stochastic rounding of ``x`` onto the sorted integer ``table``; int64 indices.

    Args:
        x: floating-point values in ``[table[0], table[-1]]`` (values outside are clamped first;
            NaN is treated as ``table[0]``, so a caller that wants NaN to propagate must carry it
            separately).
        table: strictly increasing integer levels (any integer or float dtype), e.g. THC's
            ``T_{b,g,p}`` over ``0..g``; best on the CPU (it is read on the host).
        uniform: uniforms in ``[0, 1)`` of ``x``'s shape: element ``i`` rounds up when
            ``uniform[i] < (x - a) / (c - a)``.
        backend: kernel backend (``None``: the best available).

    Returns:
        int64 indices into ``table`` of ``x``'s shape.
    """
    resolve_backend(x, backend, op="stochastic_quantize")
    _check_table(table)
    if uniform.shape != x.shape:
        raise ValueError(
            f"uniform must have x's shape {tuple(x.shape)}, got {tuple(uniform.shape)}"
        )
    levels_cpu, cell_index_cpu = table_cells(table)
    lo_level, hi_level = int(levels_cpu[0]), int(levels_cpu[-1])
    cell_index = cell_index_cpu.to(x.device)
    v = torch.nan_to_num(x, nan=float(lo_level)).clamp(lo_level, hi_level)
    cell = v.floor().to(torch.int64).sub_(lo_level).clamp_(0, hi_level - lo_level - 1)
    lower = cell_index[cell]
    fvals, inv_width = (t.to(x.device) for t in table_intervals(table, v.dtype))
    up = uniform < (v - fvals[lower]) * inv_width[lower]
    return lower + up


def table_intervals(table: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(levels, 1 / widths)`` of a sorted table in ``dtype``, on the CPU.

    Rounding up has probability ``(v - T[i]) * (1 / (T[i+1] - T[i]))``: a product with the
    interval's rounded reciprocal rather than a division (within one ulp of the exact ratio, so
    unbiased to float precision), computed once here so that every backend multiplies by the
    same bits.
    """
    _check_table(table)
    levels = table.detach().to(device="cpu", dtype=dtype)
    return levels, torch.reciprocal(levels[1:] - levels[:-1])


def table_cells(table: Tensor) -> tuple[Tensor, Tensor]:
    """``(levels, cell_index)`` of a sorted integer table, int64 on the CPU.

    ``cell_index[j]`` is the index ``i`` of the interval ``[T[i], T[i+1])`` that holds the unit
    cell ``[T[0] + j, T[0] + j + 1)``: rounding looks its interval up with one gather. The table
    is tiny, so this is built on the host (no device sync for THC's CPU table) and copied over.
    """
    _check_table(table)
    levels = table.detach().to(device="cpu", dtype=torch.int64)
    cells = torch.arange(int(levels[0]), int(levels[-1]))
    return levels, torch.searchsorted(levels, cells, right=True) - 1


def lookup(indices: Tensor, table: Tensor, *, backend: str | None = None) -> Tensor:
    """``table[indices]``: the levels of ``indices`` (any integer dtype), in ``table``'s dtype."""
    resolve_backend(indices, backend, op="lookup")
    _check_table(table)
    return table.to(indices.device)[indices.long()]


def _check_bits(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"bits must be one of {list(PACK_BITS)}, got {bits!r}")


def packed_numel(numel: int, bits: int) -> int:
    """Bytes :func:`pack_bits` produces for ``numel`` indices of ``bits`` bits."""
    _check_bits(bits)
    per_byte = _BYTE_BITS // bits
    return -(-numel // per_byte)


def pack_bits(indices: Tensor, bits: int, *, backend: str | None = None) -> Tensor:
    """Pack 1-D ``indices`` (values in ``[0, 2^bits)``) into uint8, ``8 / bits`` per byte.

    The last byte is zero-padded. Element ``k`` of byte ``j`` is index ``j * (8 / bits) + k``, in
    bits ``[k * bits, (k + 1) * bits)``.
    """
    resolve_backend(indices, backend, op="pack_bits")
    _check_bits(bits)
    flat = indices.reshape(-1).to(torch.uint8)
    if bits == _BYTE_BITS:
        return flat.clone()
    per_byte = _BYTE_BITS // bits
    n_bytes = packed_numel(flat.numel(), bits)
    padded = torch.zeros(n_bytes * per_byte, dtype=torch.uint8, device=flat.device)
    padded[: flat.numel()] = flat
    lanes = padded.view(n_bytes, per_byte)
    out = lanes[:, 0].clone()
    for k in range(1, per_byte):
        out.bitwise_or_(lanes[:, k] << (k * bits))
    return out


def unpack_bits(packed: Tensor, bits: int, numel: int, *, backend: str | None = None) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` ``bits``-bit indices, as uint8."""
    resolve_backend(packed, backend, op="unpack_bits")
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    if packed.numel() != packed_numel(numel, bits):
        raise ValueError(
            f"{numel} indices of {bits} bits pack into {packed_numel(numel, bits)} bytes, "
            f"got {packed.numel()}"
        )
    if bits == _BYTE_BITS:
        return packed.reshape(-1).clone()
    shifts = torch.arange(0, _BYTE_BITS, bits, dtype=torch.uint8, device=packed.device)
    fields = (packed.reshape(-1, 1) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(-1)[:numel].clone()


def check_packed(packed: Sequence[Tensor], bits: int, numel: int) -> None:
    """Check payloads of ``numel`` packed ``bits``-bit indices (:func:`pack_bits`).

    Raises:
        ValueError: no payloads, or a payload of the wrong dtype or size.
    """
    if not packed:
        raise ValueError("unpack_lookup_sum needs at least one packed payload, got none")
    for p in packed:
        if p.dtype != torch.uint8 or p.numel() != packed_numel(numel, bits):
            raise ValueError(
                f"{numel} indices of {bits} bits pack into {packed_numel(numel, bits)} uint8 "
                f"bytes, got {p.numel()} of {p.dtype}"
            )


def unpack_lookup_sum(
    packed: Sequence[Tensor], bits: int, numel: int, table: Tensor, *, backend: str | None = None
) -> Tensor:
    """``sum_r table[unpack_bits(packed[r])]``: int64 over ``numel`` elements, ranks in order.

    Raises:
        ValueError: no payloads, or a payload of the wrong dtype or size (:func:`unpack_bits`).
    """
    _check_table(table)
    check_packed(packed, bits, numel)
    first = packed[0]
    if resolve_backend(first, backend, op="unpack_lookup_sum", cupy=True) == "cupy":
        return cupy_thc.unpack_lookup_sum(packed, bits, numel, table)
    levels = table.to(device=first.device, dtype=torch.int64)
    total = levels[unpack_bits(first, bits, numel).long()]
    for p in packed[1:]:
        total += levels[unpack_bits(p, bits, numel).long()]
    return total


def _mix32(z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 ``z``, in place with the scratch ``y`` (NumPy's uint32 arithmetic
    wraps mod 2^32 and shifts logically)."""
    for shift, mul in ((16, _MUL1), (15, _MUL2 & _MASK32)):
        z ^= np.right_shift(z, np.uint32(shift), out=y)
        z *= np.uint32(mul)
    z ^= np.right_shift(z, np.uint32(16), out=y)
    return z


def _bits32(x: Tensor) -> Tensor:
    """The bit pattern of every element of float ``x``, folded to 32 bits, in int64 lanes."""
    if x.dtype == torch.float64:
        bits = x.contiguous().view(torch.int64)
        return (bits ^ (bits >> 32)) & _MASK32
    if x.dtype != torch.float32:
        x = x.float()
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK32


def hash_signs(
    n: int, seed: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Tensor:
    """A Rademacher vector: ``s[i] = -1`` where bit ``i mod 32`` of ``h(i // 32)`` is set.

    ``h(j)`` is :func:`hash_uniform`'s 32-bit hash of the value bits 0 at position ``j``: one
    hash gives 32 signs. Identical on every rank and device for the same ``(n, seed)``, with no
    generator: THC's CUDA kernel draws the same signs inside the kernel (``cuda/thc.cu``).
    """
    z = hash_sign_words(n, seed, device=device)
    # The hash's 4 bytes (least significant first), then their 8 bits each: the per-sign work
    # is in uint8, 8 times less memory traffic than in the int64 lanes of the hash.
    octets = torch.arange(0, _SIGNS_PER_HASH, _BYTE_BITS, device=device)
    low_bytes = ((z[:, None] >> octets) & 0xFF).to(torch.uint8)
    bit = torch.arange(_BYTE_BITS, dtype=torch.uint8, device=device)
    bits = (low_bytes[:, :, None] >> bit) & 1
    return bits.reshape(-1)[:n].to(dtype).mul_(-2.0).add_(1.0)


def _hash32(count: int, seed: int) -> np.ndarray:
    """``mix(mix(i * K + s_lo) ^ s_hi)`` for ``i < count``: uint32 (NumPy, host)."""
    seed = int(seed)
    s_lo, s_hi = seed & _MASK32, (seed >> 32) & _MASK32
    z = np.arange(count, dtype=np.uint32)
    y = np.empty_like(z)
    z *= np.uint32(_POSITION_MUL)
    z += np.uint32(s_lo)
    z = _mix32(z, y)
    z ^= np.uint32(s_hi)
    return _mix32(z, y)


def _uniform_key(offset: int, seed: int) -> int:
    """``(offset * K + s) mod 2^32`` with ``s`` the 64-bit ``seed`` folded to 32 bits."""
    folded = (int(seed) ^ (int(seed) >> 32)) & _MASK32
    return ((offset & _MASK32) * _POSITION_MUL + folded) & _MASK32


def hash_uniform(x: Tensor, seed: int, *, backend: str | None = None) -> Tensor:
    """Uniforms in ``[0, 1)`` (float32, ``x``'s shape) hashed from each element of ``x``.

    One multiply-xorshift-multiply round over 32-bit words (all arithmetic mod 2^32)::

        z = bits(x[i]) ^ (i * K + s);  z = z * M1;  z = z ^ (z >> 16);  z = z * M2
        u[i] = (z >> 8) / 2^24

    with ``s = seed_lo ^ seed_hi`` and ``M1, M2`` lowbias32's multipliers: a counter-based
    generator keyed by the data. Equal inputs (and seed) give equal uniforms; a change in any bit
    of an element, in its position or in the seed gives an unrelated uniform. This is the naive
    reference (int64 lanes, fresh temporaries) of the in-place :func:`round_levels`, which draws
    the same uniforms, and of the CUDA kernel (``cuda/common.cuh``, ``round_hash``).

    Args:
        x: a floating-point tensor (float64 bit patterns are folded to 32 bits).
        seed: a 64-bit seed, e.g. :func:`gravac.seeding.derive_seed` of (user seed, step, key).
        backend: kernel backend (``None``: the best available).
    """
    resolve_backend(x, backend, op="hash_uniform")
    if not x.is_floating_point():
        raise ValueError(f"hash_uniform needs a floating-point tensor, got {x.dtype}")
    bits = _bits32(x.reshape(-1))
    pos = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device)
    key = pos.mul_(_POSITION_MUL).add_(_uniform_key(0, seed)).bitwise_and_(_MASK32)
    z = (bits ^ key).mul_(_MUL1).bitwise_and_(_MASK32)
    z ^= z >> _XORSHIFT
    z = z.mul_(_MUL2).bitwise_and_(_MASK32)
    u = (z >> (32 - _UNIFORM_BITS)).to(torch.float32).mul_(2.0**-_UNIFORM_BITS)
    return u.view(x.shape)


#: Table shapes :func:`round_levels` special-cases (:attr:`CellTables.spacing`).
TableSpacing = Literal["two", "unit", "general"]


@dataclass(frozen=True)
class CellTables:
    """What :func:`round_levels` needs of a table over 0..g, per unit cell ``c = floor(u)``.

    Attributes:
        lower: ``T[L(c)]`` (float32), the level below the cell (cell ``g`` repeats cell
            ``g - 1``, as :func:`stochastic_quantize` clamps it).
        inv_width: ``2^24 / (T[L(c) + 1] - T[L(c)])`` (float32): the round-up probability times
            ``2^24``, exactly (a power-of-two scale of :func:`table_intervals`' reciprocal).
        level: ``T[L(c) + up]`` (or the index ``L(c) + up``) at ``2 c + up``: what is sent, in
            the narrowest unsigned dtype that holds it (uint8 up to 255, then uint16, ...):
            :func:`round_levels` writes that dtype, cheap to pack into lanes.
        spacing: ``"two"`` for the two levels ``{0, g}`` (b = 1: one cell, no gather),
            ``"unit"`` for the levels ``0, 1, ..., g`` (the uniform b = 2, g = 3 table: the cell
            is the level below, no gather), else ``"general"`` (three gathers).
        top: ``g``, the last level (what a two-level table sends on rounding up).
    """

    lower: np.ndarray
    inv_width: np.ndarray
    level: np.ndarray
    spacing: TableSpacing
    top: int

    @classmethod
    def build(cls, table: Tensor, *, indices: bool = False) -> CellTables:
        """The tables of a sorted integer ``table`` whose first level is 0 (NumPy, host);
        ``indices``: :attr:`level` holds the table index ``L(c) + up`` instead of the level."""
        levels, cell_index = table_cells(table)
        if int(levels[0]) != 0:
            raise ValueError(f"round_levels needs a table starting at 0, got {int(levels[0])}")
        lower = torch.cat([cell_index, cell_index[-1:]])
        values, inv_width = table_intervals(table, torch.float32)
        sent = torch.arange(levels.numel()) if indices else levels
        level = torch.stack([sent[lower], sent[lower + 1]], dim=1).reshape(-1)
        top = int(levels[-1])
        spacing: TableSpacing = "general"
        if levels.numel() == _TWO_LEVELS:
            spacing = "two"
        elif torch.equal(levels, torch.arange(top + 1)):
            spacing = "unit"
        return cls(
            lower=values[lower].numpy(),
            inv_width=inv_width[lower].mul_(2.0**_UNIFORM_BITS).numpy(),
            level=level.numpy().astype(np.min_scalar_type(int(level.max()))),
            spacing=spacing,
            top=1 if indices else top,
        )


class RoundingWork:
    """Reusable NumPy buffers of :func:`round_levels` and :func:`flip_signs` for chunks of up to
    ``size`` elements.

    ``positions`` holds ``i * K mod 2^32`` for ``i < size`` (uint32): the position half of the
    hash key, built once; the rest are scratch (uint32 ``z``, ``y``; float32 ``a``, ``b``; int32
    ``j``; bool ``up``).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.positions = np.arange(size, dtype=np.uint32) * np.uint32(_POSITION_MUL)
        self.z = np.empty(size, dtype=np.uint32)
        self.y = np.empty(size, dtype=np.uint32)
        self.a = np.empty(size, dtype=np.float32)
        self.b = np.empty(size, dtype=np.float32)
        self.j = np.empty(size, dtype=np.int32)
        self.up = np.empty(size, dtype=np.bool_)


def round_levels(
    u: np.ndarray, cells: CellTables, seed: int, *, offset: int, out: np.ndarray, work: RoundingWork
) -> np.ndarray:
    """``out[i] = T[SQ_T(u[i])]`` with :func:`hash_uniform`'s uniforms at positions ``offset + i``.

    The fast CPU form of ``lookup(stochastic_quantize(u, T, hash_uniform(u, seed)), T)`` over a
    chunk of a longer vector, bit for bit: the same cell, the same round-up probability
    ``p = (u - T[L]) / (T[L+1] - T[L])`` and the same uniforms, in NumPy uint32 arithmetic (which
    wraps mod 2^32 and shifts logically, so the hash needs no masks) in ``work``'s buffers (no
    temporaries). ``uniform < p`` is compared as ``z < p 2^24`` with ``z`` the hash's top 24
    bits, both exact in float32. The cell's lookups depend on :attr:`CellTables.spacing`: two
    levels ``{0, g}`` have one cell (``p 2^24 = u * inv_width``, level ``g * up``); the unit
    table's cell is ``floor(u)`` and its level ``floor(u) + up`` (at ``u = g`` the reference's
    clamped cell ``g - 1`` always rounds up to ``g``, and ``floor(g) + 0`` is ``g`` too);
    otherwise three gathers from the per-cell tables.

    Args:
        u: float32 values in ``[0, g]`` (no NaN), 1-D, at most ``work.size`` of them.
        cells: :meth:`CellTables.build` of the table.
        seed: as :func:`hash_uniform`.
        offset: position of ``u[0]`` in the vector the positions count.
        out: ``cells.level``'s dtype, ``u``'s length: receives the levels.
        work: scratch buffers.
    """
    n = u.size
    z, y, j, up = work.z[:n], work.y[:n], work.j[:n], work.up[:n]
    a, b = work.a[:n], work.b[:n]
    np.add(work.positions[:n], _uniform_key(offset, seed), out=z)
    np.bitwise_xor(z, u.view(np.uint32), out=z)
    np.multiply(z, _MUL1, out=z)
    np.right_shift(z, _XORSHIFT, out=y)
    np.bitwise_xor(z, y, out=z)
    np.multiply(z, _MUL2 & _MASK32, out=z)
    np.right_shift(z, 32 - _UNIFORM_BITS, out=z)
    # uniform * 2^24, exact; below 2^24, so converted as int32 (faster than from uint32).
    np.copyto(b, z.view(np.int32), casting="unsafe")
    if cells.spacing == "two":
        np.multiply(u, cells.inv_width[0], out=a)
        if cells.top == 1:
            # Levels {0, 1} (uint8): the comparison is the level.
            np.less(b, a, out=out.view(np.bool_))
            return out
        np.less(b, a, out=up)
        return np.multiply(up.view(np.uint8), out.dtype.type(cells.top), out=out)
    if cells.spacing == "unit":
        np.floor(u, out=a)
        np.copyto(j, a, casting="unsafe")
        np.subtract(u, a, out=a)
        np.multiply(a, cells.inv_width[0], out=a)
        np.less(b, a, out=up)
        return np.add(j, up, out=out, casting="unsafe")
    np.copyto(j, u, casting="unsafe")  # the cell floor(u), u >= 0
    np.take(cells.lower, j, out=a)
    np.subtract(u, a, out=a)
    np.multiply(a, np.take(cells.inv_width, j, out=y.view(np.float32)), out=a)
    np.less(b, a, out=up)
    np.multiply(j, 2, out=j)
    np.add(j, up, out=j)
    return np.take(cells.level, j, out=out)


def hash_sign_words(n: int, seed: int, *, device: torch.device | str = "cpu") -> Tensor:
    """The ``ceil(n / 32)`` hashes whose bits are :func:`hash_signs`' signs: ``h(j)`` in int64
    lanes holding 32-bit values (bit ``k`` of ``h(j)`` set: element ``32 j + k`` is negated).

    Hashed on the host in NumPy uint32 (:func:`sign_hashes`, what the CPU kernels use) and
    copied to ``device``: one implementation for the reference and the fast path.
    """
    return torch.from_numpy(sign_hashes(n, seed).astype(np.int64)).to(device)


def sign_hashes(n: int, seed: int) -> np.ndarray:
    """:func:`hash_sign_words` as little-endian uint32 (NumPy), the words :func:`flip_signs`
    reads."""
    return _hash32(-(-n // _SIGNS_PER_HASH), seed).astype("<u4", copy=False)


def flip_signs(
    x: np.ndarray, words: np.ndarray, *, offset: int, out: np.ndarray, work: RoundingWork
) -> np.ndarray:
    """``out = x * s[offset : offset + len(x)]`` with ``s`` :func:`hash_signs`' diagonal, by
    flipping float32 sign bits (exactly the product with +-1, NaN and zeros included).

    Args:
        x: float32, 1-D, at most ``work.size`` elements; may be ``out``.
        words: :func:`hash_sign_words` as little-endian uint32 (the whole vector's).
        offset: position of ``x[0]``, a multiple of 32.
        out: float32, ``x``'s length.
        work: scratch buffers.
    """
    if offset % _SIGNS_PER_HASH:
        raise ValueError(f"offset must be a multiple of {_SIGNS_PER_HASH}, got {offset}")
    n = x.size
    first = offset // _SIGNS_PER_HASH
    own = words[first : first + -(-n // _SIGNS_PER_HASH)]
    bits = np.unpackbits(own.view(np.uint8), count=n, bitorder="little")
    mask = work.z[:n]
    # Widened first, then shifted in uint32: faster than one shift that casts from uint8.
    np.copyto(mask, bits)
    np.left_shift(mask, np.uint32(_SIGN_SHIFT), out=mask)
    return np.bitwise_xor(x.view(np.uint32), mask, out=out.view(np.uint32)).view(np.float32)
