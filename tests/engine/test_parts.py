"""The engine's parts on their own (``gravac/engine/``: scalars, stats, flights, observe, finite,
checkpoint); the multi-process tests run them through the engine's steps."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.comm import Communicator
from gravac.compressors.base import Round
from gravac.compressors.dense import FP16Compressor
from gravac.compressors.topk import TopKCompressor
from gravac.control.records import DENSE, Plan
from gravac.engine import flights
from gravac.engine.checkpoint import check_compatible, interval_norms
from gravac.engine.finite import ends_finite, note_x, step_bound
from gravac.engine.observe import achieved_cf
from gravac.engine.records import Flight, Step, Unit
from gravac.engine.scalars import Row, SparseGradientError, Table
from gravac.engine.stats import AgreedStats
from gravac.hierarchy import Topology, group_topology

#: a row's values and statistics, none
_EMPTY = (torch.zeros(0, dtype=torch.float64), ())


def _table(*rows: tuple[int, int, int, bool], dropped: tuple[bool, ...] = ()) -> Table:
    """A table of rows ``(step, layout, sparse, stale)``, one gradient each (``dropped``: by
    rank, none by default)."""
    drops = dropped or (False,) * len(rows)
    packed = [
        Row(
            False, stale, 1.0, 0.0, 0.0, step, layout, sparse, [True], torch.zeros(8), *_EMPTY, drop
        ).pack(torch.device("cpu"))
        for (step, layout, sparse, stale), drop in zip(rows, drops, strict=True)
    ]
    return Table(torch.stack(packed), flags=1, terms=8, values=0)


def test_a_table_of_ranks_that_agree_raises_nothing() -> None:
    assert _table((3, 9, -1, False), (3, 9, -1, False)).disagreement(3) is None


@pytest.mark.parametrize(
    ("rows", "kind", "words"),
    [
        ([(3, 9, -1, False), (4, 8, 2, True)], ValueError, "different steps \\[3, 4\\]"),
        ([(3, 9, -1, False), (3, 8, 2, True)], ValueError, "rank\\(s\\) \\[1\\] train other"),
        ([(3, 9, -1, False), (3, 9, 2, True)], SparseGradientError, "parameter 2"),
        ([(3, 9, -1, True), (3, 9, -1, False)], RuntimeError, "rank\\(s\\) \\[0\\] changed"),
    ],
)
def test_a_table_names_the_first_disagreement_in_order(
    rows: list[tuple[int, int, int, bool]], kind: type[Exception], words: str
) -> None:
    """Steps before layouts before sparse gradients before stale ones: each row set also
    holds every later kind, and only the first is named."""
    error = _table(*rows).disagreement(3)
    assert type(error) is kind
    with pytest.raises(kind, match=words):
        raise error


def test_a_step_every_rank_drops_raises_nothing_whatever_its_gradients_held() -> None:
    """A sparse or changed gradient does not matter where every rank discards it; a drop on
    some ranks only, or a drop at another step, does."""
    rows = ((3, 9, 2, True), (3, 9, -1, False))
    assert _table(*rows, dropped=(True, True)).disagreement(3) is None
    some = _table(*rows, dropped=(False, True)).disagreement(3)
    assert isinstance(some, RuntimeError) and str(some).startswith("rank(s) [1] dropped step 3")
    other = _table((3, 9, -1, False), (4, 9, -1, False), dropped=(True, True))
    assert isinstance(other.disagreement(3), ValueError)
    assert _table(*rows, dropped=(True, True)).all_dropped
    assert not _table(*rows, dropped=(False, True)).all_dropped


def _step(index: int) -> Step:
    return Step(index, Plan(DENSE.cf, DENSE, measure=False), DENSE, {})


def test_lagging_statistics_are_the_last_steps_agreed_ones_and_follow_their_layers() -> None:
    """FP16's largest magnitude may lag under error feedback: the first step agrees its own
    (not stale); the next compresses with what the table said at the step before."""
    stats = AgreedStats(FP16Compressor(), feedback=True)
    base, layers, peers = Round(0, 7, 1), (4, 5), Communicator()
    x = torch.tensor([1.0, -3.0])
    (first,) = stats.rounds(_step(0), x, [2.0], base, layers, peers)
    assert not first.stale and first.agreed is not None and float(first.agreed) == 3.0
    step = _step(1)
    stats.rounds(step, x, [2.0], base, layers, peers)
    stats.keep(step, torch.tensor([[3.0], [5.0]], dtype=torch.float64))  # two ranks' rows
    (second,) = stats.rounds(_step(2), x, [2.0], base, layers, peers)
    assert second.stale and second.agreed is not None and float(second.agreed) == 5.0
    saved = stats.state_dict()
    stats.relayer({4: 0, 5: 1})
    assert list(stats.lagged) == [(0, 1)]
    stats.relayer({0: 3})  # layer 1 no longer compressed: its unit's statistics go
    assert stats.lagged == {}
    stats.load_state_dict(saved)
    assert list(stats.lagged) == [(4, 5)] and stats.lagged[(4, 5)].tolist() == [5.0]


def test_statistics_never_lag_without_error_feedback_nor_exist_without_a_rule() -> None:
    stats = AgreedStats(FP16Compressor(), feedback=False)
    base, x, peers = Round(0, 7, 1), torch.ones(3), Communicator()
    for i in range(3):
        step = _step(i)
        (rnd,) = stats.rounds(step, x, [2.0], base, (0,), peers)
        assert not rnd.stale and step.stats == []
    plain = AgreedStats(TopKCompressor(), feedback=True)
    assert plain.rounds(_step(0), x, [10.0, 20.0], base, (0,), peers) == [base, base]


def test_the_achieved_cf_is_elements_over_elements_sent() -> None:
    c = TopKCompressor()
    units = []
    for numel, cf in [(1000, 10.0), (3000, 100.0)]:
        x = torch.randn(numel)
        payload, ctx = c.compress(x, cf, Round(0, numel, 1))
        units.append(Flight(Unit(numel, (x.shape,), True), x, (payload, ctx), None, 0, None))
    sent = sum(f.unit.numel / f.sent[1].achieved_cf for f in units if f.sent is not None)
    assert achieved_cf(units) == pytest.approx(4000 / sent)
    assert achieved_cf([]) == 1.0


def test_the_absent_mask_marks_the_elements_of_tensors_no_rank_had() -> None:
    shapes = (torch.Size((2, 2)), torch.Size((3,)))
    f = Flight(Unit(0, shapes, True, slots=(0, 1)), torch.zeros(7), None, None, 0, None)
    assert flights.absent_mask(f, (True, True)) is None
    mask = flights.absent_mask(f, (True, False))
    assert mask is not None and mask.tolist() == [False] * 4 + [True] * 3


def test_a_checkpoint_of_other_nodes_compressor_or_search_is_refused_by_name() -> None:
    state = {
        "ranks_per_node": 1,
        "compressor_config": "TopKCompressor()",
        "controller_kind": "TrialController",
        "controller": {"current": 1},
    }
    flat = Topology(2, 1, 0)
    ok = {"topology": flat, "compressor": "TopKCompressor()", "policy": "P()"}
    check_compatible(state, controller_kind="ShadowController", **ok)  # window searches mix
    with pytest.raises(ValueError, match="ranks_per_node=1"):
        check_compatible(
            state, controller_kind="TrialController", **{**ok, "topology": Topology(4, 2, 0)}
        )
    with pytest.raises(ValueError, match="compressor TopKCompressor\\(\\), this one has X"):
        check_compatible(state, controller_kind="TrialController", **{**ok, "compressor": "X"})
    with pytest.raises(ValueError, match="saved by TrialController, this optimizer runs Static"):
        check_compatible(state, controller_kind="StaticController", **ok)
    old = {"controller_kind": "Controller", "controller": {"phase": "fixed"}}
    with pytest.raises(ValueError, match="saved by StaticController"):
        check_compatible(old, controller_kind="PaperController", **ok)


def test_interval_norms_are_read_from_where_the_checkpoint_kept_them() -> None:
    assert interval_norms({"interval_norms": {"acc": {1: 2}}}) == {"acc": {1: 2}}
    old = {"controller": {"accordion": {"acc": {3: 4}, "tracked": [3]}}}
    assert interval_norms(old) == {"acc": {3: 4}, "tracked": [3]}
    assert interval_norms({}) == {"acc": {}, "tracked": []}


def test_one_worker_plans_a_flat_topology() -> None:
    assert group_topology(Communicator(), 2) == Topology(1, 1, 0)


@pytest.mark.parametrize("measure", [True, False])
def test_a_non_finite_x_raises_the_flag_and_a_finite_one_bounds_its_largest_magnitude(
    measure: bool,
) -> None:
    step = _step(0)
    x = torch.tensor([3.0, -4.0])
    term = note_x(step, x, measure=measure, checked=False)
    assert float(term) == (25.0 if measure else 0.0)
    assert ends_finite(step.ends)
    assert step_bound(step) == (5.0 if measure else 4.0)  # ||x||_2 >= ||x||_inf
    note_x(step, torch.tensor([1.0, math.nan]), measure=measure, checked=False)
    assert not ends_finite(step.ends)


def test_an_x_checked_elsewhere_leaves_the_flag_and_bounds_nothing() -> None:
    step = _step(0)
    note_x(step, torch.tensor([math.inf]), measure=False, checked=True)
    assert ends_finite(step.ends) and step_bound(step) == math.inf
    assert step_bound(_step(1)) == 0.0
