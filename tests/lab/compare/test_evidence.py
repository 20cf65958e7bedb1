"""gravac_lab.compare.evidence on a scripted study summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gravac_lab.compare.evidence import (
    distances,
    evidence,
    markdown,
    shadow_checks,
    shadow_markdown,
    write_evidence_plot,
)


def _run(mode: str, variant: str | None, steps: int | None, cf: float | None, **extra: Any) -> dict:
    return {
        "mode": mode,
        "variant": variant,
        "seed": 0,
        "steps_to_target": steps,
        "cf_sent_by_step": [cf] * 4,
        **extra,
    }


def summary() -> dict[str, Any]:
    return {
        "config": {"workload": "vgg-digits"},
        "study": {
            "variants": [
                {"label": "cf100", "policy": "fixed"},
                {"label": "cf1000", "policy": "fixed"},
                {"label": "adaptive", "policy": "exponential"},
                {"label": "settled", "policy": "exponential"},
            ]
        },
        "runs": [
            _run("ddp", None, 60, None),
            _run(
                "gravac",
                "cf100",
                90,
                100.0,
                gain_step_by_step=[0.4, None, 0.5, 0.6],
                gain_window_by_step=[None, 0.7, None, None],
            ),
            _run("gravac", "cf1000", None, 1000.0),
            _run("gravac", "adaptive", 50, None, cf_sent_by_step=[10.0, 20.0]),
            _run("gravac", "settled", 50, 10.0),  # one CF sent, but searched: not static
        ],
    }


def test_rows_set_gains_beside_the_progress_per_step() -> None:
    rows = evidence([summary()])
    assert [(r.label, r.cf) for r in rows] == [("cf100", 100.0), ("cf1000", 1000.0)]
    cf100, cf1000 = rows
    assert cf100.progress == pytest.approx(60 / 90)
    assert (cf100.gain_step, cf100.gain_window) == (0.5, 0.7)
    assert cf100.cosine_window == pytest.approx(0.7**0.5)
    assert cf1000.progress == 0.0 and cf1000.gain_step is None  # never reached, unmeasured
    assert cf1000.cosine_window is None
    table = markdown(rows)
    assert "| vgg-digits | cf100 | 0 | 100 | 90 | 60 | 0.67 | 0.500 | 0.700 | 0.837 |" in table


def test_distances_are_each_gains_mean_gap_from_the_progress_above_cf_10() -> None:
    rows = evidence([summary()])
    far = distances(rows)
    # cf100 alone has both (cf1000 measured no gain): |gain - 2/3|
    assert far["gain_step"] == pytest.approx(abs(0.5 - 60 / 90))
    assert far["gain_window"] == pytest.approx(abs(0.7 - 60 / 90))
    assert far["cosine_window"] == pytest.approx(abs(0.7**0.5 - 60 / 90))
    assert distances([r for r in rows if r.cf > 100]) == dict.fromkeys(far)
    assert "window cosine 0.170" in markdown(rows)


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = write_evidence_plot(evidence([summary()]), tmp_path / "e" / "evidence.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shadow_checks_set_the_sent_cfs_shadow_gain_beside_its_real_one() -> None:
    shadowed = _run(
        "gravac",
        "shadow",
        50,
        None,
        cf_sent_by_step=[10.0, 10.0, 40.0, 1.0],
        gain_window_by_step=[None, 0.9, None, 0.5],
        gain_shadow_by_step=[None, {"10": 0.95, "40": 0.7}, None, {"10": 0.99, "40": 0.8}],
    )
    summary = {"config": {"workload": "vgg-digits", "bandwidth": "1gbit"}, "runs": [shadowed]}
    checks = shadow_checks([summary])
    assert [(c.step, c.cf, c.real, c.shadow, c.link) for c in checks] == [
        (2, 10.0, 0.9, 0.95, "1gbit")  # step 4 sent dense: no shadow of its own
    ]
    assert "| vgg-digits | 1gbit | shadow | 0 | 1 | 0.900 | 0.950 | +0.050 | +0.050 |" in (
        shadow_markdown(checks)
    )
