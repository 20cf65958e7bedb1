"""Median and min-max spread over seeds, on made-up runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gravac_lab.compare.aggregate import AGGREGATED, Spread, aggregate, spread
from tests.lab.compare import made_up


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([3.0], Spread(3.0, 3.0, 3.0)),
        ([3.0, 1.0, 2.0], Spread(2.0, 1.0, 3.0)),
        ([4.0, 1.0, 2.0, 3.0], Spread(2.5, 1.0, 4.0)),
        ([None, 2.0, None], Spread(2.0, 2.0, 2.0)),  # not measured: left out
        ([None, None], Spread(None, None, None)),
    ],
)
def test_spread_of_measured_figures(values: list[float | None], expected: Spread) -> None:
    assert spread(values) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([5.0, 1.0, 3.0], Spread(3.0, 1.0, 5.0)),
        ([None, 1.0, 3.0], Spread(3.0, 1.0, None)),  # the middle run reached it
        ([None, None, 1.0], Spread(None, 1.0, None)),  # the middle run did not
        ([2.0, 4.0, 6.0, None], Spread(5.0, 2.0, None)),  # both middle runs did
        ([2.0, 4.0, None, None], Spread(None, 2.0, None)),  # one middle run did not
        ([None], Spread(None, None, None)),
    ],
)
def test_spread_of_a_target_not_reached_sorts_it_last(
    values: list[float | None], expected: Spread
) -> None:
    assert spread(values, censored=True) == expected


def test_aggregate_groups_runs_by_mode_and_variant_in_order() -> None:
    groups = aggregate(made_up.runs())
    assert [(g.mode, g.variant) for g in groups] == [
        ("ddp", None),
        ("gravac", "cf100"),
        ("gravac", "topk-exponential"),
    ]
    assert all(g.seeds == [0, 1] for g in groups)
    assert [g.reached for g in groups] == [2, 0, 2]
    assert [g.ranks_agree for g in groups] == [None, True, True]
    assert [g.comm_source for g in groups] == ["exposed", "record", "record"]
    assert all(set(g.figures) == set(AGGREGATED) for g in groups)


def test_aggregate_takes_median_and_range_over_seeds() -> None:
    ddp, cf100, exp = aggregate(made_up.runs())
    assert ddp.figures["final_metric"] == Spread(0.96875, 0.9375, 1.0)
    assert ddp.figures["time_to_target_seconds"] == Spread(2.0, 2.0, 2.0)
    assert ddp.figures["compress_seconds"] == Spread(None, None, None)  # DDP measures none
    assert ddp.figures["wire_bytes"] == Spread(1600, 1600, 1600)
    assert cf100.figures["final_metric"] == Spread(0.625, 0.5, 0.75)
    assert cf100.figures["time_to_target_seconds"] == Spread(None, None, None)
    assert cf100.figures["steps_to_target"] == Spread(None, None, None)
    assert exp.figures["time_to_target_seconds"] == Spread(1.5, 1.0, 2.0)
    assert exp.figures["steps_to_target"] == Spread(3.0, 2, 4)
    assert exp.figures["step_seconds"] == Spread(0.1, 0.1, 0.1)


def test_one_disagreeing_run_marks_its_variant() -> None:
    runs = made_up.runs()
    runs[4] = replace(runs[4], ranks_agree=False)  # gravac cf100, seed 1
    assert [g.ranks_agree for g in aggregate(runs)] == [None, False, True]
