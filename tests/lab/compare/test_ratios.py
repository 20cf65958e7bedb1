"""gravac_lab.compare.ratios on scripted study summaries."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gravac_lab.compare.ratios import held_seconds, markdown, ratios, study_label, totals_markdown


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


def _evaluated(variant: str, metrics: list[float], target: float = 0.95) -> dict[str, Any]:
    """A run evaluated every 10 steps, one second of training apart, reaching ``target`` first
    where ``metrics`` first meets it (the harness's own time to target)."""
    evaluations = [(10 * (i + 1), float(i + 1), m) for i, m in enumerate(metrics)]
    first = next((t for _, t, m in evaluations if m >= target), None)
    return {**_run(variant, 0, first), "target": target, "evaluations": evaluations}


def test_a_held_target_needs_that_many_evaluations_in_a_row_or_the_rest_of_the_run() -> None:
    run = _evaluated("cf10", [0.96, 0.90, 0.97, 0.94, 0.96, 0.97])
    assert held_seconds(run, "vgg-digits", 1) == 1.0 == run["time_to_target_seconds"]
    assert held_seconds(run, "vgg-digits", 2) == 5.0
    assert held_seconds(run, "vgg-digits", 3) == 5.0  # meets it to the end, two left
    assert held_seconds(_evaluated("cf10", [0.9, 0.8]), "vgg-digits", 2) is None
    # perplexity is met from above
    lstm = {
        "target": 5.0,
        "evaluations": [(10, 1.0, 6.0), (20, 2.0, 4.9), (30, 3.0, 5.2), (40, 4.0, 4.8)],
    }
    assert held_seconds(lstm, "lstm-text", 1) == 2.0 and held_seconds(lstm, "lstm-text", 2) == 4.0


@pytest.mark.parametrize("hold", [0, -1, 1.5, True])
def test_a_hold_that_is_not_a_count_of_evaluations_is_refused(hold: Any) -> None:
    with pytest.raises(ValueError, match="hold must be an integer >= 1"):
        held_seconds(_evaluated("cf10", [0.96]), "vgg-digits", hold)


def test_a_held_target_needs_the_runs_evaluations() -> None:
    with pytest.raises(ValueError, match=r"'cf10' .* has no evaluations"):
        held_seconds(_run("cf10", 0, 1.0), "vgg-digits", 2)


def test_ratios_with_a_held_target_time_every_run_by_it() -> None:
    runs = [
        _evaluated("cf10", [0.96, 0.90, 0.97, 0.97]),  # first at 1 s, held from 3 s
        _evaluated("cf100", [0.90, 0.96, 0.96, 0.96]),  # first and held at 2 s
        _evaluated("search", [0.90, 0.90, 0.96, 0.97]),  # first and held at 3 s
    ]
    summary = _summary("1gbit", {**STATICS, "search": "exponential"}, runs)
    first = {r.variant: r for r in ratios([summary])}
    held = {r.variant: r for r in ratios([summary], hold=2)}
    assert first["search"].best == "cf10" and first["search"].ratio == 3.0
    assert held["search"].best == "cf100" and held["search"].ratio == 1.5
    assert held["cf10"].seconds == 3.0
