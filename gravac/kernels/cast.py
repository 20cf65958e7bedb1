"""16-bit casts fused with the world-size scaling (the fp16 / bf16 compressors), and their inverse.

``scaled_cast(x, dtype, divisor, exponent, limit) = (clamp(float32(x), -B, B) * fl32(2^exponent /
divisor)).to(dtype)`` with ``B = limit / fl32(2^exponent / divisor)`` (capped at float32's
largest value), the pre-image of ``limit``, by default the format's largest finite value ``M``:
a finite value never becomes Inf and NaN stays NaN. The division by ``divisor`` before the cast
(as PyTorch's ``fp16_compress_hook``) keeps the all-reduced sum of ``divisor`` contributions in
range when their inputs are, and a ``limit`` of ``M / (2 divisor)`` keeps it there whatever they
are; the power-of-two ``exponent`` moves the values into the format's range exactly
(:class:`gravac.compressors.dense.FP16Compressor`).
Multiplying by the rounded reciprocal, not dividing, is what torch's CUDA division by a scalar
computes, so the torch reference and the CuPy kernel (one fused pass,
:mod:`gravac.kernels.cupy_cast`) agree bit for bit on every device.

On the CPU the torch implementation runs the reference's operations chunk by chunk
(:data:`CAST_CHUNK` elements): each chunk is clamped and scaled in a small float32 buffer that
stays in cache and is cast into its slice of the output, so the gradient is read once and the
16-bit payload written once, where the reference writes and reads a float32 intermediate of the
gradient's size. Every element goes through the same operations as in the reference, so the
results are bit-identical (:func:`scaled_cast_reference`, :func:`scaled_widen_reference`,
:func:`sub_scaled_reference`, which the tests compare against). The inverse, ``scaled_widen``
(``D(v_1 + ... + v_n) = (v_1 + ... + v_n) * s`` in the gradient's dtype, the sum in 16 bits as
the all-reduce computes it), and the residual update ``sub_scaled_`` (``x - s v`` in place) are
chunked the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from gravac.kernels import cupy_cast
from gravac.kernels.backend import resolve_backend

__all__ = [
    "CAST_CHUNK",
    "scaled_cast",
    "scaled_cast_reference",
    "scaled_widen",
    "scaled_widen_reference",
    "sub_scaled_",
    "sub_scaled_reference",
]

#: Elements per chunk of the CPU passes: a 1 MiB float32 work buffer, which with the chunk's
#: 16-bit slice stays in cache (a core's L2 or its share of the L3) between the operations on it,
#: and few enough chunks (64 per 16M elements) that torch's per-operation overhead (microseconds)
#: stays small. Measured on 16M float32 elements, one thread: 12.3 ms a cast at 2^16, 10.0 at
#: 2^17, 8.9 at 2^18, 8.5-9.5 up to 2^21; the unchunked reference takes 45-55 ms. A multiple of
#: every SIMD width, so chunking puts no element in a vector loop's scalar tail that the
#: whole-tensor operation would not.
CAST_CHUNK = 1 << 18


def _check(dtype: torch.dtype, divisor: int) -> None:
    if dtype not in cupy_cast.WIRE_DTYPES:
        raise ValueError(f"dtype must be one of {list(cupy_cast.WIRE_DTYPES)}, got {dtype}")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be an int >= 1, got {divisor!r}")


def _scale_and_bound(
    dtype: torch.dtype, divisor: int, exponent: int, limit: float | None
) -> tuple[float, float]:
    """``(2^exponent / divisor, B)``, ``B`` the pre-image of ``limit`` (``None``: ``dtype``'s
    largest finite value).

    Raises:
        ValueError: ``limit`` is not a positive number.
    """
    if limit is None:
        limit = torch.finfo(dtype).max
    elif not (isinstance(limit, (int, float)) and 0 < limit < math.inf):
        raise ValueError(f"limit must be a positive finite number or None, got {limit!r}")
    scale = math.ldexp(1.0, exponent) / divisor
    return scale, min(limit / scale, torch.finfo(torch.float32).max)


def _chunk_size(t: Tensor) -> int:
    """:data:`CAST_CHUNK` on the CPU; elsewhere the whole tensor (one kernel per operation)."""
    return CAST_CHUNK if t.device.type == "cpu" else max(1, t.numel())


def _chunks(*tensors: Tensor) -> Iterator[tuple[Tensor, ...]]:
    """Matching slices of :func:`_chunk_size` elements of flat tensors of one length."""
    size = _chunk_size(tensors[0])
    return zip(*(t.split(size) for t in tensors), strict=True)


def _work(like: Tensor, dtype: torch.dtype) -> Tensor:
    """The buffer a chunk is computed in (chunk-sized: fresh each call, malloc reuses it)."""
    return torch.empty(min(_chunk_size(like), like.numel()), dtype=dtype, device=like.device)


def scaled_cast_reference(
    x: Tensor,
    dtype: torch.dtype,
    *,
    divisor: int = 1,
    exponent: int = 0,
    limit: float | None = None,
) -> Tensor:
    """:func:`scaled_cast` in whole-tensor torch operations: the reference."""
    _check(dtype, divisor)
    scale, bound = _scale_and_bound(dtype, divisor, exponent, limit)
    return x.detach().reshape(-1).float().clamp(-bound, bound).mul_(scale).to(dtype)


def scaled_cast(
    x: Tensor,
    dtype: torch.dtype,
    *,
    divisor: int = 1,
    exponent: int = 0,
    limit: float | None = None,
    backend: str | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Flat ``x`` scaled by ``2^exponent / divisor``, clamped to ``+-limit`` (``None``:
    ``dtype``'s finite range), cast.

    Args:
        out: a contiguous flat ``dtype`` tensor of ``x.numel()`` elements on ``x``'s device to
            write into (``None``: a new one); it must not overlap ``x``.

    Raises:
        ValueError: ``dtype`` is not float16 or bfloat16, ``divisor`` is below 1, ``limit`` is
            not positive, or ``out`` does not fit.
    """
    _check(dtype, divisor)
    scale, bound = _scale_and_bound(dtype, divisor, exponent, limit)
    flat = x.detach().reshape(-1)
    if out is None:
        out = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
    elif (
        out.shape != flat.shape
        or out.dtype != dtype
        or out.device != flat.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous flat {dtype} tensor of {flat.numel()} elements on "
            f"{flat.device}, got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )
    if (
        resolve_backend(flat, backend, op="scaled_cast", cupy=cupy_cast.supports(x, dtype))
        == "cupy"
    ):
        return cupy_cast.scaled_cast(flat, dtype, bound, scale, out=out)
    work = _work(flat, torch.float32)
    for xc, oc in _chunks(flat, out):
        buf = work[: xc.numel()]
        if xc.dtype == torch.float32:
            torch.clamp(xc, -bound, bound, out=buf)
        else:  # the reference rounds to float32 before it clamps
            buf.copy_(xc).clamp_(-bound, bound)
        oc.copy_(buf.mul_(scale))
    return out


def scaled_widen_reference(values: Sequence[Tensor], scale: float, dtype: torch.dtype) -> Tensor:
    """:func:`scaled_widen` in whole-tensor torch operations: the reference."""
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total.to(dtype, copy=True).mul_(scale)


def scaled_widen(values: Sequence[Tensor], scale: float, out: Tensor) -> Tensor:
    """``out = (v_1 + ... + v_n) * scale`` in ``out``'s dtype: the 16-bit ``values`` summed in
    their dtype, in order (what an all-reduce of them computes), then widened and scaled.

    ``values`` and ``out`` are flat tensors of one length, ``out`` overlapping none of them.
    Returns ``out``.
    """
    if not values:
        raise ValueError("scaled_widen() needs at least one tensor, got none")
    work = _work(out, values[0].dtype) if len(values) > 1 else None
    for oc, first, *rest in _chunks(out, *values):
        total = first if work is None else work[: first.numel()].copy_(first)
        for vc in rest:
            total.add_(vc)
        oc.copy_(total).mul_(scale)
    return out


def sub_scaled_reference(x: Tensor, values: Tensor, scale: float) -> Tensor:
    """:func:`sub_scaled_` in whole-tensor torch operations: the reference."""
    # torch's mixed-dtype in-place path is 4x slower than the cast plus this one
    return x.sub_(values.view(x.shape).to(x.dtype), alpha=scale)


def sub_scaled_(x: Tensor, values: Tensor, scale: float) -> Tensor:
    """``x -= scale * values`` in place (the 16-bit ``values`` widened to ``x``'s dtype first),
    for ``values`` flat with ``x.numel()`` elements. Returns ``x``."""
    if not x.is_contiguous():
        return sub_scaled_reference(x, values, scale)
    flat = x.view(-1)
    work = _work(flat, x.dtype)
    for xc, vc in _chunks(flat, values.reshape(-1)):
        xc.sub_(work[: vc.numel()].copy_(vc), alpha=scale)
    return x
