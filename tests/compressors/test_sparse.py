"""Properties shared by the all-gather sparsifiers (Top-k, DGC, RedSync)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gravac import compressors
from gravac.compressors import Round, k_for_cf
from gravac.compressors.sparse import SparseCompressor
from tests.compressors.inputs import KINDS, gradient_like

SPARSE = [n for n in compressors.names() if issubclass(compressors.get(n), SparseCompressor)]


def test_the_sparsifiers_are_registered() -> None:
    assert {"topk", "dgc", "redsync"} <= set(SPARSE)


@pytest.mark.parametrize("name", SPARSE)
@given(
    shape=st.lists(st.integers(1, 60), min_size=1, max_size=3),
    cf=st.floats(1.0, 2000.0),
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
)
@settings(max_examples=60, deadline=None)
def test_exact_top_k_distinct_in_range(
    name: str, shape: list[int], cf: float, seed: int, kind: str, dtype: torch.dtype
) -> None:
    """Exactly k distinct in-range indices, the values at them, the k largest magnitudes."""
    d = math.prod(shape)
    x = gradient_like(kind, d, torch.Generator().manual_seed(seed)).to(dtype).view(shape)
    c = compressors.create(name)
    payload, ctx = c.compress(x, cf, Round(step=seed % 100))
    k = k_for_cf(d, cf)
    idx = payload.indices.long()  # type: ignore[attr-defined]
    assert idx.numel() == k == idx.unique().numel()
    assert int(idx.min()) >= 0 and int(idx.max()) < d
    assert torch.equal(payload.values, x.reshape(-1)[idx])  # type: ignore[attr-defined]
    assert ctx.achieved_cf == d / k
    # every unsent magnitude is at most the smallest sent one
    mag = x.reshape(-1).abs().float()
    unsent = torch.ones(d, dtype=torch.bool)
    unsent[idx] = False
    if bool(unsent.any()):
        assert float(mag[unsent].max()) <= float(mag[idx].min())
