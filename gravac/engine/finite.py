"""What a step knows of its values' finiteness, at little cost (docs/design.md sections 4 and 12).

Each rank raises one flag a step, non-finite or not, from the ends (minimum and maximum) of what
it compressed, or from ``||x||^2`` where the gain needs it anyway; and it sends a bound on
``max |x|``, from which a compressor may vouch that an aggregate is finite without a look at
it (:meth:`gravac.compressors.base.Compressor.mean_bound`). A non-finite flag on any rank skips
the step on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gravac.engine.records import Step
from gravac.gain import squared_norm

__all__ = ["all_finite", "ends", "ends_finite", "note_x", "step_bound"]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of every tensor is finite, with one host sync.

    From each tensor's minimum and maximum (``aminmax`` propagates NaN, and an Inf is one of
    them): one reduction without a boolean copy, 25x faster than ``isfinite(t).all()`` on 2M
    float32 elements on one CPU thread (0.26 against 6.8 ms).
    """
    return ends_finite([ends(t) for t in tensors])


def ends(t: Tensor) -> Tensor:
    """``[min, max]`` of ``t``, in float64 (NaN if ``t`` holds one); empty for an empty ``t``
    (``aminmax`` has no identity)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.float64, device=t.device)
    return torch.stack(torch.aminmax(t.detach().reshape(-1))).to(torch.float64)


def ends_finite(found: Sequence[Tensor]) -> bool:
    """Whether every value of ``found`` (ends, or norms) is finite, with one host sync."""
    if not found:
        return True
    return bool(torch.isfinite(torch.cat([e.to(found[0].device) for e in found])).all())


def note_x(step: Step, x: Tensor, *, measure: bool, checked: bool) -> Tensor:
    """Note what a compressed unit's ``x = g + e`` tells ``step``'s non-finite flag and bound
    on ``max |x|``, and return ``||x||^2`` where the plan ``measure``s gains (a gain term),
    else 0.

    With a finite residual, ``x`` is finite exactly when ``g`` is, and ``||x||^2`` (float64,
    where float32 would overflow) is NaN or Inf exactly when ``x`` is not: the flag, with
    ``||x||_inf <= ||x||_2`` the bound. Unmeasured, ``x``'s ends give both; where its check
    is ``checked`` elsewhere (a plain sum checked at commit, or statistics that are the
    check), the bound is infinite.
    """
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    if measure:
        xx = squared_norm(x)
        step.ends.append(xx.reshape(1))
        step.bounds.append(xx.sqrt().reshape(1))
        return xx
    if not checked:
        found = ends(x)
        step.ends.append(found)
        step.bounds.append(found.abs().amax(dim=0, keepdim=True) if found.numel() else found)
    else:
        step.bounds.append(torch.full((1,), math.inf, dtype=torch.float64, device=x.device))
    return zero


def step_bound(step: Step) -> float:
    """The bound on ``max |x|`` over what ``step`` compressed on this rank (0: nothing)."""
    bounds = [b.reshape(-1) for b in step.bounds if b.numel()]
    if not bounds:
        return 0.0
    device = bounds[0].device
    return float(torch.cat([b.to(device) for b in bounds]).max())
