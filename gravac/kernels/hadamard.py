"""Fast Walsh-Hadamard transform (FWHT), orthonormal, full or partial.

The Sylvester-Hadamard matrix ``H_n`` (``n = 2^m``, ``H_1 = [1]``,
``H_{2k} = [[H_k, H_k], [H_k, -H_k]] = H_2 (x) H_k``) factors into ``m`` butterfly stages::

    H_n = prod_{s=0}^{m-1} (I_{n / 2^{s+1}} (x) H_2 (x) I_{2^s})

where the stage of stride ``h = 2^s`` maps every pair ``(v[i], v[i + h])`` (``i`` with bit ``s``
clear) to ``(v[i] + v[i + h], v[i] - v[i + h])``. The stages commute, so ``H_n`` costs
``n log2(n)`` additions instead of ``n^2`` multiply-adds. Scaled by ``n^(-1/2)`` the transform is
orthonormal and symmetric, hence its own inverse (THC, Li et al., NSDI 2024, section 5.1: the
randomised Hadamard transform ``n^(-1/2) H D x``).

*Partial* transform (``stages=t``): only the last ``t`` stages, strides ``n / 2^t ... n / 2``,
scaled by ``2^(-t/2)``. Exactly::

    fwht(x, stages=t) == (H_{2^t} (x) I_{n / 2^t}) x / 2^(t/2)

i.e. ``x.view(2^t, n / 2^t)`` transformed along its first axis: it mixes elements ``n / 2^t``
apart (THC's all-reduce follow-up runs the same last ``t`` stages). A transform of contiguous
blocks of ``B = 2^t`` elements, ``(I_{n / B} (x) H_B) x / sqrt(B)``, is the full transform of the
rows of ``x.view(n / B, B)``: that is what THC's partial rotation in
:mod:`gravac.compressors.thc.encoding` uses.

:func:`fwht_rows` is the fast form of the full transform of rows: ``H_B = H_{f_1} (x) ... (x)
H_{f_m}`` with factors of at most :data:`MAX_FACTOR_LOG2` stages, each one dense GEMM along one
axis of ``x.view(rows, f_1, ..., f_m)``, so ``log2(B) / 5`` passes over the data instead of
``log2 B`` butterfly stages. It sums the same terms in another order, so it equals :func:`fwht`
to float rounding (bit for bit only when every partial sum is exact and ``log2 B`` even);
:func:`fwht` stays the reference the tests compare it with.

Vectorised torch on any device (reshape-based butterflies, one temporary of half the input per
stage). The CuPy transform is fused into THC's compression (``cuda/thc.cu``); on its own it has
no CuPy kernel, so ``backend="cupy"`` raises here (see :mod:`gravac.kernels.backend`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from gravac.kernels.backend import resolve_backend

__all__ = ["MAX_FACTOR_LOG2", "fwht", "fwht_rows", "is_power_of_two", "next_power_of_two"]

#: Largest Kronecker factor of :func:`fwht_rows`, ``H_32``: one (rows, 32) @ (32, 32) GEMM runs
#: near the CPU's peak (16M float32 in 22 ms on one AVX2 core), while smaller factors waste it
#: (``H_8``: 35 ms for 3 stages instead of 5) and larger ones cost more flops per stage.
MAX_FACTOR_LOG2 = 5
#: Factor matrices kept by :func:`fwht_rows` (factor sizes x two scales x dtypes x devices).
_FACTOR_CACHE = 64


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is a power of two (1, 2, 4, ...)."""
    return n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    """The least power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fwht(x: Tensor, *, stages: int | None = None, backend: str | None = None) -> Tensor:
    """Orthonormal fast Walsh-Hadamard transform of the last dimension of ``x``; a new tensor.

    Args:
        x: floating-point tensor whose last dimension ``n`` is a power of two (any leading
            dimensions are a batch).
        stages: ``None`` for the full transform ``H_n / sqrt(n)``; ``t`` in ``[0, log2 n]`` for
            the partial transform ``(H_{2^t} (x) I_{n / 2^t}) / 2^(t/2)`` (module docstring).
            Both are symmetric and orthonormal, so applying the same call twice gives ``x`` back.
        backend: kernel backend (``None``: the best available).

    Raises:
        ValueError: ``x`` is not floating point or has no dimension, its last dimension is not a
            power of two, or ``stages`` is out of range.
    """
    resolve_backend(x, backend, op="fwht")
    if not x.is_floating_point():
        raise ValueError(f"fwht needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("fwht needs a tensor with at least one dimension, got a scalar")
    n = x.shape[-1]
    if not is_power_of_two(n):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {n}")
    log_n = n.bit_length() - 1
    if stages is None:
        stages = log_n
    if isinstance(stages, bool) or not isinstance(stages, int) or not 0 <= stages <= log_n:
        raise ValueError(f"stages must be an int in [0, {log_n}] for length {n}, got {stages!r}")
    lead = x.shape[:-1]
    out = x.reshape(-1, n).clone()
    if out.numel() == 0 or stages == 0:
        return out.view(*lead, n)
    h = n >> stages
    while h < n:
        # Pairs (v[.., 0, :], v[.., 1, :]) are h apart: one butterfly stage, in place.
        v = out.view(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        tmp = a.clone()
        a.add_(b)
        b.sub_(tmp).neg_()  # b <- a_old - b
        h *= 2
    out.mul_(math.pow(2.0, -stages / 2.0))
    return out.view(*lead, n)


@functools.lru_cache(maxsize=_FACTOR_CACHE)
def _hadamard(log_n: int, scale: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``scale * H_{2^log_n}`` (Sylvester): ``scale * (-1)^popcount(i & j)``, built once."""
    idx = torch.arange(1 << log_n, device=device)
    parity = torch.zeros((1 << log_n, 1 << log_n), dtype=torch.int64, device=device)
    both = idx[:, None] & idx[None, :]
    for bit in range(log_n):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).to(dtype).mul_(scale)


def fwht_rows(x: Tensor, *, out: Tensor, work: Tensor) -> Tensor:
    """``out = x H_B / sqrt(B)`` for the rows of 2-D ``x`` (``B`` its power-of-two width).

    By Kronecker factors (module docstring): ``x`` is read once and each factor is one GEMM from
    one of ``out`` and ``work`` (same shape and dtype as ``x``) into the other; the
    normalisation ``B^(-1/2)`` is folded into the last factor's matrix (exact when ``log2 B``
    is even: a power of two). The factor matrices are cached, so a call on a small chunk costs
    only its GEMMs. ``x`` may be ``out``; ``work`` must not alias either.

    Raises:
        ValueError: ``x`` is not 2-D floating point of power-of-two width, or ``out``/``work``
            differ from it in shape or dtype.
    """
    if x.dim() != 2 or not x.is_floating_point() or not is_power_of_two(x.shape[1]):
        raise ValueError(
            f"fwht_rows needs 2-D floating rows of power-of-two width, got {tuple(x.shape)} "
            f"{x.dtype}"
        )
    for name, t in (("out", out), ("work", work)):
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"{name} must match x's {tuple(x.shape)} {x.dtype}, got {t.dtype}")
    width = x.shape[1]
    log_b = width.bit_length() - 1
    factors = [MAX_FACTOR_LOG2] * (log_b // MAX_FACTOR_LOG2)
    if log_b % MAX_FACTOR_LOG2:
        factors.append(log_b % MAX_FACTOR_LOG2)
    if not factors:
        return out.copy_(x)
    # Ping-pong so that the last factor lands in out; x is read only by the first factor, so when
    # x is out and the first factor would write out, x moves to work first.
    targets = [out if (len(factors) - i) % 2 else work for i in range(len(factors))]
    src, inner = x, width
    if targets[0].data_ptr() == x.data_ptr():
        # An odd number of factors: from work, out, work, ..., out.
        src = work.copy_(x)
        targets = [out if i % 2 == 0 else work for i in range(len(factors))]
    last = len(factors) - 1
    for i, (log_f, dst) in enumerate(zip(factors, targets, strict=True)):
        f = 1 << log_f
        inner //= f
        scale = math.pow(2.0, -log_b / 2.0) if i == last else 1.0
        h = _hadamard(log_f, scale, x.dtype, x.device)
        if inner == 1:
            torch.matmul(src.reshape(-1, f), h, out=dst.view(-1, f))
        else:
            torch.matmul(h, src.reshape(-1, f, inner), out=dst.view(-1, f, inner))
        src = dst
    return out
