"""THC's encoding and decoding, the reference (Li et al., NSDI 2024; docs/design.md section 10).

Every rank quantises its gradient onto integer levels that can be *summed* by the collective and
decompressed once, after aggregation, so nothing is decompressed and re-compressed in between::

    y = clamp(sqrt(B) / l * RHT(x), -t_p, t_p)                 rotate, normalise, clamp
    u = (y + t_p) * g / (2 t_p)                                 onto [0, g]
    z = SQ_T(u)                                                 index into T_{b,g,p}
    send T[z] (allreduce, integer lanes) or z packed in b bits (allgather)
    sum_i T[z_i]  ->  (S - N g / 2) * 2 t_p / g * l / sqrt(B)  ->  RHT^-1  ->  un-pad

:func:`thc_encode` computes ``z`` (the torch reference), :func:`thc_payload` the tensor sent
(the reference or, on CUDA, the fused CuPy kernel :mod:`gravac.kernels.cupy_thc`, bit for bit),
:func:`thc_decode` the sum of the ranks' estimates from the sum of their levels.

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
  so the exchange needs no transformed data), agreed through
  :meth:`~gravac.compressors.thc.compressor.THCCompressor.local_stats` (:func:`block_norms`)
  reduced by ``"max"``. A rotated coordinate is then about ``N(0, ||x||^2 / B)``. With
  partial rotation every block has its own norm, reduced across ranks block by block: one global
  scale over block-rotated heavy-tailed data leaves most blocks far below the clamp and the table
  (measured on log-normal(0, 2), 2^16 elements, blocks of 2^10: NMSE 0.067 with one global
  max-norm against 0.015 with per-block norms; the project's first brief quoted 0.19 against
  0.020).
* Clamp at ``t_p = Phi^-1(1 - p/2)`` (a fraction ``p`` of normal coordinates) and stochastic
  rounding onto the optimal table ``T_{b,g,p}`` (:mod:`gravac.compressors.thc.table`; by default
  the mirror-symmetric optimum, which reproduces THC's published table for (4, 30, 1/32)).
  Rounding is unbiased inside the clamp; the clamp's bias is left to error feedback (the memory
  gets ``D(C(x))`` of this rank's own payload, outside the compressor). Ranks with similar
  gradients clamp alike, so that bias does not average out over ranks: the NMSE of the N-rank
  average falls as 1/N down to about ``clamp_error(p)`` (0.0073 at p = 1/32).

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

import torch
from torch import Tensor

from gravac.compressors.thc.records import Encoding, THCContext, _compute_dtype
from gravac.kernels import cupy_thc, resolve_backend
from gravac.kernels.hadamard import fwht
from gravac.kernels.quantize import (
    hash_signs,
    hash_uniform,
    lookup,
    pack_bits,
    stochastic_quantize,
    table_cells,
    table_intervals,
)

__all__ = ["block_norms", "block_scale", "thc_decode", "thc_encode", "thc_payload"]

#: Bits of a byte: ``b``-bit indices are packed ``8 / b`` to a byte.
_BYTE_BITS = 8
#: Device copies of THC tables kept (a few bit widths x lanes x devices).
_TABLE_CACHE = 64
#: a row norm below this (2^-60, about 8.7e-19) is recomputed at a power-of-two scale: float32
#: squares of its elements lose bits from 2^-63 (the square root of the smallest normal) down
_LEAST_NORM = 2.0**-60


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
    """L2 norm of each row in ``dtype``. Rows whose sum of squares leaves the range of ``dtype``
    (float32's overflows from elements of about 1e17 up, and underflows to 0 or loses bits
    below :data:`_LEAST_NORM`) are recomputed as ``2^e ||2^-e row||``, ``2^e`` the power of two
    of the row's largest magnitude: exact scaling, so a row scaled by a power of two has its
    norm scaled by it, bit for bit, and finite input always gives a finite norm."""
    norms = torch.linalg.vector_norm(rows, dim=1, dtype=dtype)
    redo = (torch.isinf(norms) | (norms < _LEAST_NORM)).nonzero().reshape(-1)
    if redo.numel():
        part = rows.index_select(0, redo).to(dtype)
        _, e = torch.frexp(part.abs().amax(dim=1, keepdim=True))
        scaled = torch.linalg.vector_norm(torch.ldexp(part, -e), dim=1)
        norms[redo] = torch.ldexp(scaled, e[:, 0])
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
