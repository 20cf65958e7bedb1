"""``scripts/aggregate_gain.py``: the aggregate's window gain beside the per-rank one."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_script


def test_identical_ranks_keep_as_much_in_the_aggregate_as_each_keeps() -> None:
    gains = load_script("aggregate_gain").gains
    s, x = torch.tensor([3.0, 0.0, 1.0]), torch.tensor([3.0, 2.0, 1.0])
    own, agg = gains([s, s], [x, x])
    assert own == pytest.approx(agg) == pytest.approx(10.0 / 14.0)


def test_what_the_ranks_hold_back_in_opposite_directions_cancels_in_the_aggregate() -> None:
    gains = load_script("aggregate_gain").gains
    sent = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])]
    totals = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])]
    # each rank kept half its energy; their sums agree: the aggregate kept everything
    assert gains(sent, totals) == (pytest.approx(0.5), pytest.approx(1.0))
    assert gains([torch.zeros(2)], [torch.zeros(2)]) == (1.0, 1.0)


def test_at_cf_1_nothing_is_held_back_and_both_gains_are_1() -> None:
    script = load_script("aggregate_gain")
    run = script.train("tiny-digits", 2, 1.0, 0, 10, 2.0, 5)
    assert run.steps_to_bar is None  # a bar above any accuracy is never held
    assert [w[0] for w in run.windows] == [5, 10]
    for _, own, agg in run.windows:
        assert own == pytest.approx(1.0) and agg == pytest.approx(1.0)
