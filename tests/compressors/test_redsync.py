"""RedSync: threshold mean + r (max - mean) by binary search on r, exactly k sent."""

from __future__ import annotations

import math

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round, k_for_cf
from gravac.compressors import redsync as redsync_module
from gravac.compressors.base import Multilevel
from gravac.compressors.redsync import RedSyncCompressor, redsync_threshold
from tests.compressors.inputs import KINDS, gradient_like


def _redsync() -> RedSyncCompressor:
    c = compressors.create("redsync")
    assert isinstance(c, RedSyncCompressor)
    return c


class _Spy:
    """Records the (threshold, nnz) of every count the search makes; ``inf`` for a threshold
    below the CPU scan's floor, which selects at least the whole pool (>= 2k)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[float, float]] = []
        real = redsync_module._Pool.count

        def count(pool: redsync_module._Pool, thr: float) -> int | None:
            n = real(pool, thr)
            self.calls.append((thr, math.inf if n is None else n))
            return n

        monkeypatch.setattr(redsync_module._Pool, "count", count)


def _full_pass_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the search count over every element (as on CUDA) instead of the CPU scan's pool."""
    monkeypatch.setattr(redsync_module, "magnitude_scan", lambda *a, **kw: None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [1, 7, 1000, 100_003])
@pytest.mark.parametrize("cf", [1.0, 1.7, 10.0, 100.0, 1000.0])
def test_keeps_exactly_k(kind: str, d: int, cf: float) -> None:
    x = gradient_like(kind, d, torch.Generator().manual_seed(d))
    payload, ctx = _redsync().compress(x, cf, Round())
    k = k_for_cf(d, cf)
    idx = payload.indices.long()  # type: ignore[attr-defined]
    assert payload.values.numel() == idx.numel() == k == idx.unique().numel()  # type: ignore[attr-defined]
    assert torch.equal(payload.values, x[idx])  # type: ignore[attr-defined]
    assert ctx.achieved_cf == d / k


@pytest.mark.parametrize("kind", ["normal", "lognormal"])
@pytest.mark.parametrize("cf", [10.0, 100.0, 1000.0])
def test_selection_equals_exact_topk(kind: str, cf: float) -> None:
    gen = torch.Generator().manual_seed(5)
    c = _redsync()
    d = 100_000
    k = k_for_cf(d, cf)
    for _ in range(5):
        x = gradient_like(kind, d, gen)
        idx = c.select(x, k, Round())
        ref = torch.topk(x.abs(), k).indices
        assert torch.equal(x.abs()[idx].sort().values, x.abs()[ref].sort().values)


@pytest.mark.parametrize("pool", ["scan", "full"])
def test_binary_search_lands_in_the_window(monkeypatch: pytest.MonkeyPatch, pool: str) -> None:
    """The search starts at r = 1/2, halves the interval towards the side that has too many or
    too few entries, never leaves [mean, max], and stops at the first k <= nnz < 2k."""
    if pool == "full":
        _full_pass_only(monkeypatch)
    spy = _Spy(monkeypatch)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    mag = x.abs()
    mean, peak = float(mag.mean()), float(mag.max())
    c = _redsync()
    k = 200
    c.select(x, k, Round())
    thresholds = [t for t, _ in spy.calls]
    counts = [n for _, n in spy.calls]
    assert thresholds[0] == pytest.approx(redsync_threshold(mean, peak, 0.5))
    assert all(mean <= t <= peak for t in thresholds)
    assert k <= counts[-1] < 2 * k
    assert all(not (k <= n < 2 * k) for n in counts[:-1])
    for (t0, n0), (t1, _) in zip(spy.calls, spy.calls[1:], strict=False):
        assert (t1 < t0) if n0 < k else (t1 > t0)  # too few: lower the threshold, else raise it
    assert len(spy.calls) == c.searches <= redsync_module._MAX_SEARCH_ITERS
    assert c.fallbacks == 0


def test_all_equal_magnitudes_fall_back_and_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal magnitudes make thr(r) constant: nnz = d >= 2k for every r, so the search fails
    after a single pass and the exact top-k of that selection is sent."""
    spy = _Spy(monkeypatch)
    x = gradient_like("constant", 10_000, torch.Generator().manual_seed(2))
    c = _redsync()
    idx = c.select(x, 100, Round())
    assert c.fallbacks == 1 and len(spy.calls) == 1
    assert idx.numel() == 100 == idx.unique().numel()
    # With d < 2k the single pass is inside the window: no fallback.
    c.select(x, 6000, Round())
    assert c.fallbacks == 1


def test_ties_at_the_maximum_stop_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    x = torch.zeros(10_000)
    x[:1000] = 2.0  # mean 0.2, max 2: any threshold in (0.2, 2] selects the 1000 ties
    c = _redsync()
    idx = c.select(x, 100, Round())
    assert c.fallbacks == 1
    assert len(spy.calls) < redsync_module._MAX_SEARCH_ITERS
    assert bool((x[idx] == 2.0).all()) and idx.numel() == 100


def test_failed_search_without_a_superset_uses_the_full_topk() -> None:
    """At CF 1.7 on Gaussian data fewer than k entries exceed the mean: the search cannot reach
    nnz >= k, and the exact top-k of all values is sent (counted)."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    c = _redsync()
    k = k_for_cf(10_000, 1.7)
    idx = c.select(x, k, Round())
    assert c.fallbacks == 1
    assert set(idx.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_nonfinite_inputs_are_sent() -> None:
    x = torch.randn(5000)
    x[3], x[4000] = math.nan, -math.inf
    c = _redsync()
    idx = c.select(x, 10, Round())
    assert {3, 4000} <= set(idx.tolist())
    assert c.fallbacks == 1 and c.searches == 0


def test_bad_backend_and_flags() -> None:
    with pytest.raises(ValueError, match="backend"):
        compressors.create("redsync", backend="opencl")
    c = _redsync()
    assert c.collective == "allgather" and isinstance(c, Multilevel)


@pytest.mark.parametrize("cf", [30.0, 100.0, 1000.0])
def test_the_cpu_scan_searches_as_counting_everything(
    monkeypatch: pytest.MonkeyPatch, cf: float
) -> None:
    """Counting only the scan's pool (a superset of the 2k largest) visits the same thresholds
    and selects the same entries as counting every element."""
    x = gradient_like("lognormal", 300_000, torch.Generator().manual_seed(3))
    k = k_for_cf(x.numel(), cf)
    assert redsync_module.magnitude_scan(x, 2 * k) is not None  # this input takes the scan
    runs = []
    for full in (False, True):
        with monkeypatch.context() as m:
            if full:
                _full_pass_only(m)
            spy = _Spy(m)
            c = _redsync()
            idx = c.select(x, k, Round())
            runs.append((spy.calls, idx.sort().values, c.fallbacks))
    (scan_calls, scan_idx, scan_fb), (full_calls, full_idx, full_fb) = runs
    assert [t for t, _ in scan_calls] == pytest.approx([t for t, _ in full_calls], rel=1e-5)
    for (_, a), (_, b) in zip(scan_calls, full_calls, strict=True):
        assert a == b or (a == math.inf and b >= 2 * k)
    assert torch.equal(scan_idx, full_idx) and scan_fb == full_fb
