"""``gravac bench shadow``: its rows, the memory it reports, its command line (no timing
assertions)."""

from __future__ import annotations

import json

import pytest

from gravac.cli import main
from gravac.control.replay import SHADOW_STRIDE
from gravac.control.window import sample_size
from gravac_lab.bench import shadow
from gravac_lab.bench.common import model_layout

SIZE = 1 << 16


def test_a_row_per_policy_with_its_ladder_and_the_shadows_memory() -> None:
    rows = shadow.bench_shadow(size=SIZE, repeats=1)
    assert [r.policy for r in rows] == ["exponential", "geometric"]
    assert rows[0].cfs == (10.0, 20.0, 40.0, 160.0, 1000.0)
    assert rows[1].cfs == (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1000.0)
    sampled = sum(sample_size(s.numel(), SHADOW_STRIDE) for s in model_layout(SIZE))
    for r in rows:
        # a residual, this window's sum and the earlier window's per CF (the default horizon
        # of two), float32, and the sample's int32 indices
        assert r.state_bytes == (3 * len(r.cfs) + 1) * sampled * 4
        assert r.gradient_bytes == SIZE * 4
        assert min(r.sample_s, r.replay_s, r.copy_s) > 0.0
        assert r.of_copy == pytest.approx((r.sample_s + r.replay_s) / r.copy_s)


def test_the_command_prints_json_rows_and_takes_no_compressor_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "shadow", "--size", "64K", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["exponential", "geometric"]
    with pytest.raises(SystemExit) as info:
        main(["bench", "shadow", "--compressors", "topk"])
    assert info.value.code == 2
    assert "unrecognized arguments: --compressors" in capsys.readouterr().err
