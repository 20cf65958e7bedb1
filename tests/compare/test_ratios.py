"""gravac.compare.ratios on scripted study summaries."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gravac.compare.ratios import markdown, ratios, study_label, totals_markdown


def _run(variant: str, seed: int, seconds: float | None, mb: float = 1.0) -> dict[str, Any]:
    return {
        "mode": "gravac",
        "variant": variant,
        "seed": seed,
        "time_to_target_seconds": seconds,
        "wire_bytes": int(mb * 1e6),
        "final_metric": 0.98,
    }


def _summary(
    bandwidth: str | None, variants: dict[str, str], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "config": {"workload": "vgg-digits", "bandwidth": bandwidth},
        "study": {"variants": [{"label": k, "policy": p} for k, p in variants.items()]},
        "runs": [{"mode": "ddp", "variant": None, "seed": 0}, *runs],
    }


STATICS = {"cf10": "fixed", "cf100": "fixed"}


def test_each_run_is_set_against_the_fastest_static_cf_of_its_study_and_seed() -> None:
    first = _summary(
        "1gbit",
        {**STATICS, "search": "exponential"},
        [
            _run("cf10", 0, 10.0),
            _run("cf100", 0, 8.0),
            _run("search", 0, 12.0),
            _run("cf10", 1, 6.0),
            _run("cf100", 1, None),  # not reached: never the best
            _run("search", 1, 3.0),
        ],
    )
    # a later study of the same workload and link, with a new variant on the same seeds
    later = _summary("1gbit", {"new": "geometric"}, [_run("new", 0, 4.0), _run("new", 1, None)])
    # another link: its statics are its own
    other = _summary(None, {**STATICS, "new": "geometric"}, [_run("cf10", 0, 2.0)])
    rows = {(r.study, r.variant, r.seed): r for r in ratios([first, later, other])}
    assert rows[("vgg-digits 1gbit", "search", 0)].ratio == pytest.approx(12.0 / 8.0)
    assert rows[("vgg-digits 1gbit", "search", 0)].best == "cf100"
    assert rows[("vgg-digits 1gbit", "search", 1)].ratio == pytest.approx(3.0 / 6.0)
    assert rows[("vgg-digits 1gbit", "new", 0)].ratio == pytest.approx(4.0 / 8.0)
    assert math.isinf(rows[("vgg-digits 1gbit", "new", 1)].ratio)
    assert rows[("vgg-digits 1gbit", "cf100", 0)].ratio == 1.0
    assert rows[("vgg-digits loopback", "cf10", 0)].ratio == 1.0
    assert study_label(other) == "vgg-digits loopback"


def test_a_seed_without_a_static_cf_at_the_target_gives_no_rows() -> None:
    s = _summary(
        "1gbit",
        {**STATICS, "search": "exponential"},
        [
            _run("cf10", 0, None),
            _run("search", 0, 5.0),
        ],
    )
    assert ratios([s]) == []


def test_the_tables_give_medians_over_seeds_and_the_studies_within_the_target() -> None:
    runs = [_run("cf10", seed, 10.0, mb=100.0) for seed in range(3)]
    runs += [_run("search", 0, 10.5, mb=20.0), _run("search", 1, 30.0), _run("search", 2, None)]
    rows = ratios([_summary("1gbit", {**STATICS, "search": "exponential"}, runs)])
    table = markdown(rows)
    assert "| search | 3.00 (1.05 / 3.00 / –) | 0 of 1 |" in table
    assert "| cf10 | 1.00 (1.00 / 1.00 / 1.00) | 1 of 1 |" in table
    assert "seeds 0, 1, 2" in table
    assert "| search | 1 MB, 0.980 |" in totals_markdown(rows)
    assert "| cf10 | 100 MB, 0.980 |" in totals_markdown(rows)
