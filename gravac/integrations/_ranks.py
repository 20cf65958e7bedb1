"""Every rank's hook state in a framework's checkpoint: what both callbacks share.

Residuals are per rank: each rank's is what it still owes the mean aggregate, ``(1/W) e_r``.
A run resumed on as many processes loads each rank's own state; one resumed on ``W'``
processes gives every rank the mean of the ``W`` saved residuals, so that together they still
owe ``(1/W') sum_r' e' = (1/W) sum_r e``: nothing is lost or counted twice.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from gravac.ddp import GravacHookState

__all__ = ["load_mean", "mean_residuals", "on_cpu"]


def on_cpu(state: Any) -> Any:
    """``state`` with every tensor in it on the CPU (an object gather pickles them, and a rank
    must not unpickle another rank's CUDA tensors onto that rank's device)."""
    if isinstance(state, Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(v) for v in state)
    return state


def mean_residuals(states: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The hook state (:meth:`gravac.ddp.GravacHookState.state_dict`) every rank of a run of
    ``world_size`` processes loads from the ``states`` of another number of processes, in rank
    order: rank 0's (the search's state and counters are the same on every rank), each
    residual piece the mean of the ranks' by parameter position (a rank without the piece adds
    zeros), summed in float64, and the world size its own.

    Raises:
        ValueError: ``states`` is empty.
    """
    if not states:
        raise ValueError("mean_residuals() needs at least one rank's state, got none")
    positions = sorted({k for s in states for k in s["residuals"]})
    mean: dict[int, Tensor] = {}
    for k in positions:
        pieces = [torch.as_tensor(s["residuals"][k]) for s in states if k in s["residuals"]]
        total = torch.stack([p.double() for p in pieces]).sum(0)
        mean[k] = total.div_(len(states)).to(pieces[0].dtype)
    return {**states[0], "residuals": mean, "world_size": world_size}


def load_mean(
    state: GravacHookState, states: list[dict[str, Any]], world_size: int, saved: str
) -> None:
    """Load into ``state`` what every rank of a run of ``world_size`` processes resumes with
    from the ``states`` another number of processes saved (:func:`mean_residuals`), with a
    warning that names where they were ``saved``."""
    warnings.warn(
        f"{saved} was saved by world_size={len(states)} processes, this run has world_size="
        f"{world_size}: every rank resumes with the mean of the saved residuals (what they "
        "would have added to the mean aggregate)",
        stacklevel=3,
    )
    state.load_state_dict(mean_residuals(states, world_size))
