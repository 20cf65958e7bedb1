"""The scoreboard's twins (``--twins``): the chance a run as good as a CF meets the bound, the
twins' rows and ratios on made-up stored results, their table, and the plan that trains them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.scoreboard import (
    TARGET_RATIO,
    TWIN_BATCHES,
    TWINS,
    chance,
    chance_at_least,
    score,
    twin_ratios,
)
from gravac_lab.compare.scoreboard_plan import INTERLEAVED, Inputs, parse_setups, plan, settings
from gravac_lab.compare.scoreboard_table import format_scoreboard
from gravac_lab.compare.study import parse_variant
from tests.lab.compare.scoreboard_made_up import (
    SEEDS,
    lstm_loopback,
    made_run,
    stored_scoreboard,
    study,
    vgg_1gbit,
)

GOOD = 0.985  # at vgg_1gbit's bar (0.98)


def test_the_chance_that_a_median_of_seeds_meets_the_bound() -> None:
    assert chance([1.0, 1.1], 3) == 1.0
    assert chance([1.2, math.inf], 3) == 0.0
    # half at the bound: three draws meet it in the median as often as not
    assert chance([1.0, 2.0], 3) == pytest.approx(0.5)
    # p = 2/3: P(at least 2 of 3) = p^3 + 3 p^2 (1 - p) = 20/27
    assert chance([1.0, TARGET_RATIO, 1.3], 3) == pytest.approx(20 / 27)
    assert chance([1.0, 1.3, 1.3], 1) == pytest.approx(1 / 3)
    assert chance([1.0, 1.3, math.nan], 3) == pytest.approx(0.5)  # nan: nothing compared
    assert chance([1.2], 3, target=1.25) == 1.0


def test_the_chance_that_luck_scores_a_median_at_least_a_ratio() -> None:
    assert chance_at_least([1.0, 2.0], 3, 2.0) == pytest.approx(0.5)  # 2.0 itself counts
    assert chance_at_least([1.0, 2.0], 3, 1.0) == 1.0
    assert chance_at_least([1.0, 2.0], 3, 2.5) == 0.0
    assert chance_at_least([1.0, math.inf], 3, math.inf) == pytest.approx(0.5)  # a miss as bad


@pytest.mark.parametrize(
    ("values", "seeds", "message"),
    [
        ([1.0], 2, "seeds must be a positive odd count, got 2"),
        ([1.0], 0, "seeds must be a positive odd count, got 0"),
        ([math.nan], 3, "at least one ratio that is a number"),
        ([], 3, "at least one ratio that is a number"),
    ],
)
def test_the_chance_refuses_what_it_cannot_judge(
    values: list[float], seeds: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        chance(values, seeds)


def _with_twins() -> list[dict[str, object]]:
    """:func:`vgg_1gbit` and its ladder's twins on loopback: cf10's twin holds the bar one
    evaluation later on seeds 0 and 1 (steps 30, not 20) and as early on seed 2; cf100's twin
    reaches it on every seed, at step 10, where cf100 itself misses it on seed 2."""
    studies = vgg_1gbit()
    late = [made_run("cf10", s, [0.9, 0.9, GOOD, GOOD]) for s in (0, 1)]
    twins = [*late, made_run("cf10", 2, [0.9, GOOD, GOOD, GOOD])]
    twins += [made_run("cf100", s, [GOOD, GOOD, GOOD, GOOD]) for s in SEEDS]
    studies.insert(2, study(TWINS, "vgg-digits", None, twins))
    return studies


def test_a_twin_is_timed_on_the_link_as_its_cf_and_judged_against_it() -> None:
    (s,) = score(stored_scoreboard(_with_twins(), "vgg-digits@1gbit"))
    assert s.yardstick == "cf10"  # the twins do not compete for it
    twin = s.row("cf10 twin")
    assert twin.kind == "twin"
    # cf10's step on the link is 0.2 s (its timing run) against 0.1 s on loopback
    assert [r.seconds for r in twin.reaches] == pytest.approx([6.0, 6.0, 4.0])
    assert twin.ratios == pytest.approx((1.5, 1.5, 1.0))  # against the yardstick: cf10 itself
    ratios = twin_ratios(s)
    assert ratios["cf10"] == pytest.approx([1.5, 1.5, 1.0])
    # cf100 missed the bar on seed 2 and its twin did not: the twin's ratio there is 0
    assert ratios["cf100"] == pytest.approx([1.0, 1.0, 0.0])


def test_without_twins_there_are_no_twin_rows() -> None:
    (s,) = score(stored_scoreboard(vgg_1gbit(), "vgg-digits@1gbit"))
    assert twin_ratios(s) == {}
    assert all(r.kind != "twin" for r in s.rows)
    assert "twin" not in format_scoreboard(stored_scoreboard(vgg_1gbit(), "vgg-digits@1gbit"))


def test_the_twins_table() -> None:
    stored = stored_scoreboard(_with_twins(), "vgg-digits@1gbit")
    stored["scoreboard"]["twins"] = True
    table = format_scoreboard(stored)
    assert "- twins: every static CF trained again on loopback" in table
    # every twin's ratio: 1.5, 1.5, 1.0 (cf10), 1.0, 1.0, 0.0 (cf100): 4 of 6 at 1.15 or below,
    # the chance that the median of 3 is: p^3 + 3 p^2 (1 - p) at p = 2/3
    # the default's ratio is 0.75 on every seed: luck gives a median that low or lower only where
    # two of three draws are below it (the 0.0 alone, p = 1/6): 3 p^2 (1 - p) + p^3 = 16/216
    assert (
        f"| vgg-digits@1gbit | cf10 twin | 1.50 (1.00-1.50) | 1.00 (0.00-1.50) | 4 of 6 | "
        f"{20 / 27:.2f} | {1 - 16 / 216:.2f} |" in table
    )
    assert "| cf10 twin | twin | 6.0 (4.0-6.0) | 1.50 (1.00-1.50) | yes (3/3) |" in table
    assert "on all" not in table  # one setup: its own chance is the whole of it


def test_the_chance_on_every_setup_is_the_product() -> None:
    studies = _with_twins() + lstm_loopback()
    # lstm-text's twins: cf10's holds the bar as its CF does, cf100's never (nor does cf100)
    twins = [made_run("cf10", s, [9.0, 5.1, 5.1, 5.0], 0.2) for s in SEEDS]
    twins += [made_run("cf100", s, [6.0, 5.5, 5.3, 5.2], 0.05) for s in SEEDS]
    studies.append(study(TWINS, "lstm-text", None, twins))
    stored = stored_scoreboard(studies, "vgg-digits@1gbit,lstm-text@loopback")
    table = format_scoreboard(stored)
    # lstm-text: cf10's twins 1.0 on every seed, cf100's nothing to compare (left out): chance 1
    assert "| lstm-text@loopback | cf10 twin | 1.00 | 1.00 | 3 of 3 | 1.00 | 1.00 |" in table
    assert (
        f"meet 1.15 on all 2 setups above (the product; the setups taken as independent): "
        f"{20 / 27:.2f}" in table
    )
    # an even count of seeds has no chance to give
    even = {**stored, "scoreboard": {**stored["scoreboard"], "seeds": [0, 1]}}
    assert "on all" not in format_scoreboard(even)


def test_the_plan_trains_each_seeds_twins_right_after_its_static_cfs() -> None:
    """With the twins the ladder's study (interleaved on loopback or not) is one a seed, each
    followed by its seed's twins: the same CFs, the same configuration but the batches."""
    base = CompareConfig(steps=20, eval_every=5)
    setups = parse_setups("tiny-digits@loopback")
    searches = (parse_variant("default=topk:exponential"),)
    inputs = Inputs(base, setups, (10.0, 100.0), searches, (0, 1), 8, twins=True)
    planned = plan(inputs)
    assert [p.role for p in planned] == ["dense", INTERLEAVED, TWINS, INTERLEAVED, TWINS]
    assert planned[0].study.seeds == (0, 1)
    for seed, (ladder, twins) in enumerate([planned[1:3], planned[3:5]]):
        assert ladder.study.seeds == twins.study.seeds == (seed,)
        labels = [v.label for v in ladder.study.variants]
        assert labels == ["cf10", "cf100", "default"]
        assert [v.label for v in twins.study.variants] == list(ladder.ladder) == labels[:2]
        assert (ladder.study.config.batches, twins.study.config.batches) == (0, TWIN_BATCHES)
        assert twins.study.config == replace(ladder.study.config, batches=TWIN_BATCHES)
    assert settings(inputs)["twins"] is True
    shaped = plan(replace(inputs, setups=parse_setups("tiny-digits@1gbit")))
    roles = [(p.role, p.link, p.study.seeds) for p in shaped]
    assert roles[:5] == [
        ("dense", None, (0, 1)),
        ("ladder", None, (0,)),
        (TWINS, None, (0,)),
        ("ladder", None, (1,)),
        (TWINS, None, (1,)),
    ]
    assert [p.role for p in plan(Inputs(base, setups, (10.0,), searches, (0, 1), 8))] == [
        "dense",
        INTERLEAVED,
    ]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_batch_order_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match=f"batches must be an integer >= 0, got {value!r}"):
        CompareConfig(batches=value)  # type: ignore[arg-type]
