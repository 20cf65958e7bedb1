"""Residual entries in float's subnormal range, flushed to zero on the CPU.

Error feedback keeps ``e <- x - D(C(x))``. Where a compressor's estimate is a dense
approximation (THC, PowerSGD), a block of zero gradients keeps a residual that shrinks by the
compressor's relative error each step, through float32's normal range and on into its
subnormal one (below ``2^-126``) before it reaches zero. An x86 core runs arithmetic on
subnormal operands on a slow path (microcode assists, tens of times slower), so a step slows
down for as long as the residual stays there (docs/studies/2026-12-06-subnormals.md).
:func:`flush_subnormal_` zeroes those entries as a core's flush-to-zero mode would: a change of
less than ``2^-126`` an entry (float32), which the residual would otherwise carry on to zero
over the next steps.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["flush_subnormal_"]

#: The largest subnormal magnitude of each dtype flushed (the next float below its least
#: normal), the threshold of :func:`torch.hardshrink`, which zeroes ``|x| <= lambda``.
_LARGEST_SUBNORMAL = {
    dtype: float(np.nextafter(np.array(torch.finfo(dtype).tiny, dtype=kind), kind(0)))
    for dtype, kind in ((torch.float32, np.float32), (torch.float64, np.float64))
}


def flush_subnormal_(t: Tensor) -> Tensor:
    """``t`` with its subnormal entries (and ``-0``) set to ``+0`` in place: one pass of
    :func:`torch.hardshrink` at the largest subnormal; NaN and Inf are kept.

    Only float32 and float64 tensors on the CPU are changed; others are returned as they are:
    a GPU handles subnormals at full speed, and the CPU computes on 16-bit tensors in float32,
    where their subnormals are normal values.
    """
    threshold = _LARGEST_SUBNORMAL.get(t.dtype)
    if threshold is None or t.device.type != "cpu":
        return t
    return torch.hardshrink(t, threshold, out=t)
