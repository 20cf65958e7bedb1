"""In-process simulation of N workers: the bucket layout reaches the compressor."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gravac import compressors
from gravac.compressors.powersgd import rank_for_cf
from gravac.simulation import simulate

#: Two weight matrices packed into one flat bucket, as the optimizer's bucketing does.
LAYOUT = (torch.Size((32, 64)), torch.Size((64, 32)))
#: Rank of each matrix, and the rank PowerSGD is asked for.
RANK = 2
#: CF at which PowerSGD picks rank RANK for both matrices: mn / (r (m + n)).
CF = 32 * 64 / (RANK * (32 + 64))
#: Per-worker scales of one shared gradient: the mean stays of rank RANK per matrix.
SCALES = (1.0, 3.0)
#: float32 reconstruction of exactly representable input, relative to the input's norm.
EXACT_RTOL = 1e-5


def _low_rank_bucket(seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    parts = [
        torch.randn(s[0], RANK, generator=gen) @ torch.randn(RANK, s[1], generator=gen)
        for s in LAYOUT
    ]
    return torch.cat([p.reshape(-1) for p in parts])


def test_cf_picks_the_rank() -> None:
    assert all(rank_for_cf(s[0], s[1], CF) == RANK for s in LAYOUT)


def test_without_layout_powersgd_sends_a_flat_bucket_dense() -> None:
    grads = [s * _low_rank_bucket(0) for s in SCALES]
    result = simulate(compressors.create("powersgd"), grads, CF)
    assert result.achieved_cf == 1.0


@pytest.mark.parametrize("workers", [1, len(SCALES)])
def test_powersgd_compresses_per_matrix_of_the_layout(workers: int) -> None:
    bucket = _low_rank_bucket(0)
    grads = [s * bucket for s in SCALES[:workers]]
    truth = torch.stack(grads).mean(dim=0)
    c = compressors.create("powersgd")
    first = simulate(c, grads, CF, step=0, layout=LAYOUT)
    # One factor per matrix travels: 32 x 2 and 64 x 2 of the 4096 elements on a left step.
    sent = sum(s[0] * RANK for s in LAYOUT)
    assert first.achieved_cf == pytest.approx(bucket.numel() / sent)
    assert all(b == sent * bucket.element_size() for b in first.wire_bytes)
    # Two steps make one power iteration: the second reconstructs each rank-RANK matrix exactly.
    second = simulate(c, grads, CF, step=1, layout=LAYOUT)
    assert second.achieved_cf > 1.0
    err = float((second.mean - truth).norm() / truth.norm())
    assert err < EXACT_RTOL
