"""Shared by the THC tests: the CF that selects b = 4, the NMSE and its one-worker bound."""

from __future__ import annotations

import torch

from gravac import compressors
from gravac.simulation import simulate

__all__ = ["CF_B4", "FULL_NMSE_BOUND", "nmse", "one_worker_nmse"]

#: the project's first brief: one worker at b = 4 with the full rotation.
FULL_NMSE_BOUND = 0.025
CF_B4 = 8.0


def nmse(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    err = (estimate.double() - truth.double()).square().sum()
    return float(err / truth.double().square().sum())


def one_worker_nmse(c: compressors.Compressor, x: torch.Tensor, step: int = 0) -> float:
    return nmse(simulate(c, [x], CF_B4, step=step).mean, x)
