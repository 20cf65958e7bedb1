"""Compression gain (GraVAC, Tyagi and Swany, CLOUD 2023, section III; docs/design.md section 6).

GraVAC measures the information a compressed gradient keeps as the ratio of the variance of the
compressed gradient to the variance of the error-fed gradient. We compute it as the squared cosine
similarity of ``x = g + e`` and what is sent, ``c = D(C(x))``, accumulated in float64 (float32
partial sums over cache-sized chunks, added in float64: :func:`inner`)::

    gain = <c, x>^2 / (||c||^2 ||x||^2)  in [0, 1]

For projection-type compressors (Top-k, DGC, RedSync, unscaled Random-k, PowerSGD)
``<c, x> = ||c||^2`` and the gain is ``||c||^2 / ||x||^2``, the paper's variance ratio for
zero-mean gradients. A zero ``x`` has gain 1 by definition; a zero ``c`` with non-zero ``x`` has 0.

Gains over a whole model (several buckets) and over ranks add their three terms first:
:func:`gain_terms` gives the terms of one tensor, :func:`gain_from_terms` the gain of a sum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "compression_gain",
    "gain_from_terms",
    "gain_terms",
    "inner",
    "kept_terms",
    "squared_norm",
]

#: below this magnitude, a float32 sum of products may have lost terms to underflow (products
#: under about 1e-38 are subnormal or 0 in float32): it is taken again in float64
_FLOAT32_SAFE_MIN = 2.0**-60
#: elements per float32 partial sum of :func:`squared_norm`: small enough that float32
#: accumulation loses nothing that matters to a gain, large enough to keep the loop short
_NORM_CHUNK = 2**20


def inner(a: Tensor, b: Tensor) -> Tensor:
    """``<a, b>`` as a float64 scalar on ``a``'s device, without float64 copies.

    Partial sums over chunks of :data:`_NORM_CHUNK` elements in float32 (BLAS dot, 40x faster
    than float64 copies and a dot on 16M elements), added in float64. If a partial sum is not
    finite (huge values overflow float32's range in a product) or the total is tiny in
    magnitude (tiny products underflow), the sum is taken again in float64: the result is the
    float64 one to float32 rounding (about 1e-5 relative), finite whenever that is (one host
    sync).
    """
    fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
    if fa.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=a.device)
    pairs = list(zip(fa.split(_NORM_CHUNK), fb.split(_NORM_CHUNK), strict=True))
    parts = torch.stack([torch.dot(ca.float(), cb.float()) for ca, cb in pairs])
    total = parts.to(torch.float64).sum()
    if bool(torch.isfinite(parts).all() & (total.abs() >= _FLOAT32_SAFE_MIN)):
        return total
    return torch.stack([torch.dot(ca.double(), cb.double()) for ca, cb in pairs]).sum()


def squared_norm(x: Tensor) -> Tensor:
    """``||x||^2`` as a float64 scalar, without a float64 copy (:func:`inner`)."""
    return inner(x, x)


def kept_terms(values: Tensor) -> Tensor:
    """``[<c, x>, ||c||^2]`` (float64) for a ``c`` that keeps ``values``, entries of ``x`` at
    distinct positions, and zeros elsewhere: both are the sum of the squared values, so no
    dense decompression is needed."""
    v = values.reshape(-1).to(torch.float64)
    vv = torch.dot(v, v)
    return torch.stack([vv, vv])


def gain_terms(x: Tensor, sent: Tensor) -> Tensor:
    """``[<c, x>, ||c||^2, ||x||^2]`` as a float64 tensor of shape (3,) on ``x``'s device."""
    if x.shape != sent.shape:
        raise ValueError(
            f"gain needs tensors of one shape, got x {tuple(x.shape)} and sent {tuple(sent.shape)}"
        )
    return torch.stack([inner(sent, x), squared_norm(sent), squared_norm(x)])


def gain_from_terms(terms: Tensor) -> float:
    """Gain of summed terms ``[<c, x>, ||c||^2, ||x||^2]``; NaN if any term is not finite."""
    dot, cc, xx = (float(t) for t in terms.tolist())
    if not all(math.isfinite(t) for t in (dot, cc, xx)):
        return math.nan
    if xx == 0.0:
        return 1.0
    if cc == 0.0:
        return 0.0
    # The squared cosine; the clamp removes float64 rounding just above 1.
    return min(1.0, dot * dot / (cc * xx))


def compression_gain(x: Tensor, sent: Tensor) -> float:
    """Gain of sending ``sent`` for the error-fed gradient ``x`` (see module docstring)."""
    return gain_from_terms(gain_terms(x, sent))
