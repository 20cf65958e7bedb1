"""``gravac bench multilevel``: argument checks and the CFs reached (no timing assertions)."""

from __future__ import annotations

import pytest

from gravac_lab.bench import multilevel

SIZE = 4096


def test_bench_multilevel_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="cf1 must be below cf2"):
        multilevel.bench_multilevel(size=64, cf1=100.0, cf2=10.0)
    with pytest.raises(ValueError, match="multi-level"):
        multilevel.bench_multilevel(["none"], size=64)


def test_bench_multilevel_matches_direct_cf() -> None:
    rows = multilevel.bench_multilevel(size=SIZE, cf1=10.0, cf2=100.0, repeats=1)
    assert [r.name for r in rows] == multilevel.multilevel_names()
    for r in rows:
        assert r.achieved_cf1 >= 1.0
        assert r.achieved_cf2_multilevel == pytest.approx(r.achieved_cf2_direct, rel=0.5)
        assert r.ratio > 0.0
