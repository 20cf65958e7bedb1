"""The scoreboard's bar, time to the bar, yardstick and ratios on made-up stored results; its
table rebuilt from JSON; its options' errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gravac.cli import main
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.scoreboard import (
    ACCORDION,
    PERPLEXITY_SHARE,
    Reach,
    bar,
    bar_evaluation,
    link_clock,
    ratios,
    reach,
    score,
    score_setup,
    sent_most,
    setup_runs,
    versus,
    versus_sent,
    yardstick,
)
from gravac_lab.compare.scoreboard_plan import (
    INTERLEAVED,
    Inputs,
    ladder_variants,
    parse_setups,
    plan,
    settings,
)
from gravac_lab.compare.scoreboard_table import format_scoreboard
from gravac_lab.compare.study import parse_variant
from tests.lab.compare.scoreboard_made_up import (
    EVERY,
    SEEDS,
    lstm_loopback,
    made_run,
    stored_scoreboard,
    study,
    vgg_1gbit,
    vgg_1gbit_with_baselines,
)


def test_the_bar_is_dense_s_median_less_a_point_or_plus_3_percent_perplexity() -> None:
    assert bar([0.99, 0.97, 0.98], higher_is_better=True) == pytest.approx(0.97)
    assert bar([5.0, 4.0, 6.0], higher_is_better=False) == pytest.approx(5.0 * 1.03)
    assert PERPLEXITY_SHARE == 0.03
    with pytest.raises(ValueError, match="at least one seed"):
        bar([], higher_is_better=True)


def test_the_bar_holds_for_two_evaluations_in_a_row() -> None:
    # a lucky evaluation followed by one below does not count; the last alone does not either
    assert bar_evaluation([0.5, 0.97, 0.9, 0.97, 0.98], 0.96, True) == 3
    assert bar_evaluation([0.5, 0.97, 0.9, 0.97], 0.96, True) is None
    # perplexity: lower is better
    assert bar_evaluation([9.0, 5.1, 5.0], 5.15, False) == 1
    assert bar_evaluation([9.0, 5.2, 5.1], 5.15, False) is None


def test_time_to_the_bar_by_the_run_s_clock() -> None:
    one = made_run("cf10", 1, [0.5, 0.97, 0.98], step_seconds=0.1)
    own = reach(one, 0.96, True)
    assert (own.seed, own.step, own.seconds, own.mb) == (1, 20, pytest.approx(2.0), 20.0)
    missed = reach(one, 0.99, True)
    assert (missed.seconds, missed.step, missed.mb, missed.final_metric) == (None, None, None, 0.98)


def test_a_static_cf_that_misses_the_bar_on_a_seed_is_not_the_yardstick() -> None:
    fast_but_missed = [Reach(0, 1.0, 10, 1.0, 0.98), Reach(1, None, None, None, 0.9)]
    slow = [Reach(0, 3.0, 30, 1.0, 0.98), Reach(1, 4.0, 40, 1.0, 0.98)]
    slower = [Reach(0, 5.0, 30, 1.0, 0.98), Reach(1, 5.0, 40, 1.0, 0.98)]
    assert yardstick({"cf100": fast_but_missed, "cf20": slower, "cf10": slow}) == "cf10"
    assert yardstick({"cf100": fast_but_missed}) is None


def test_ratios_are_per_seed_and_a_miss_is_infinite() -> None:
    yard = [Reach(0, 2.0, 20, 1.0, 0.98), Reach(1, 4.0, 40, 1.0, 0.98)]
    run = [Reach(0, 3.0, 30, 1.0, 0.98), Reach(1, None, None, None, 0.9)]
    assert ratios(run, yard) == [1.5, math.inf]
    with pytest.raises(ValueError, match="seed 2"):
        ratios([Reach(2, 1.0, 10, 1.0, 0.98)], yard)


def test_a_setup_on_a_shaped_link() -> None:
    s = score_setup(vgg_1gbit(), "vgg-digits", "1gbit")
    assert s.setup == "vgg-digits@1gbit"
    assert s.bar == pytest.approx(0.98)
    # cf100 (1 s a seed where reached) misses seed 2: cf10 (20 steps x 0.2 s) is the yardstick
    assert s.row("cf100").reached == 2
    assert s.yardstick == "cf10"
    assert [r.seconds for r in s.row("cf10").reaches] == [pytest.approx(4.0)] * 3
    # dense: timed on the link (0.5 s a step), at the bar from step 20
    assert [r.seconds for r in s.row("ddp").reaches] == [pytest.approx(10.0)] * 3
    default = s.row("default")
    assert default.ratios == pytest.approx((0.75, 0.75, 0.75))  # its own clock: 20 x 0.15 s
    assert default.reached_every_seed
    paper = s.row("paper")
    assert paper.ratios == pytest.approx((1.5, 1.5, math.inf))
    assert not paper.reached_every_seed
    assert [r.kind for r in s.rows] == ["dense", "static", "static", "search", "search"]
    # the runs behind it, every clock on the link: the ladder's by its timing run's step time
    runs = setup_runs(vgg_1gbit(), "vgg-digits", "1gbit")
    assert [e[1] for e in runs.statics["cf10"][0]["evaluations"]] == pytest.approx([2, 4, 6, 8])
    assert [e[1] for e in runs.searches["default"][0]["evaluations"]] == pytest.approx(
        [1.5, 3.0, 4.5, 6.0]
    )  # its own clock
    assert [r["step_seconds"] for r in runs.timing["ddp"]] == [0.5]  # one seed timed


def test_a_shaped_link_timed_seed_by_seed() -> None:
    """Timing runs and searches stored a seed at a time (as the scoreboard interleaves them):
    each seed's static CFs are timed on the link by that seed's timing run."""
    dense, ladder, _, searches = vgg_1gbit()
    studies = [dense, ladder]
    for seed in SEEDS:
        cf10_step = 0.2 * (1 + seed)  # 0.2, 0.4 and 0.6 s on the link
        timed = [made_run(None, seed, [0.5], 0.5), made_run("cf10", seed, [0.5], cf10_step)]
        timed.append(made_run("cf100", seed, [0.5], 0.1))
        studies.append(study("timing", "vgg-digits", "1gbit", timed))
        runs = [r for r in searches["summary"]["runs"] if r["seed"] == seed]
        studies.append(study("searches", "vgg-digits", "1gbit", runs))
    s = score_setup(studies, "vgg-digits", "1gbit")
    # cf10 at the bar from step 20: 20 steps of its seed's step on the link
    assert [r.seconds for r in s.row("cf10").reaches] == pytest.approx([4.0, 8.0, 12.0])
    assert s.row("default").ratios == pytest.approx((0.75, 0.375, 0.25))  # 3 s on each seed
    timing = setup_runs(studies, "vgg-digits", "1gbit").timing
    assert {label: [r["seed"] for r in runs] for label, runs in timing.items()} == {
        label: list(SEEDS) for label in ("ddp", "cf10", "cf100")
    }
    # cut short before seed 2's searches: the setup is not finished
    assert [x.setup for x in score(stored_scoreboard(studies, "vgg-digits@1gbit"))] == [
        "vgg-digits@1gbit"
    ]
    assert score(stored_scoreboard(studies[:-1], "vgg-digits@1gbit")) == []


def test_a_static_run_on_a_link_keeps_what_its_own_clock_holds_beyond_its_median() -> None:
    """Trained on loopback at a median 0.1 s a step, its clock 0.3 s ahead of 10 steps of that
    (a first step's one-off cost): on a link of 0.25 s a step it keeps the 0.3 s."""
    run = made_run("cf10", 0, [0.5, 0.9])
    run["evaluations"] = [(10, 1.3, 0.5), (20, 2.3, 0.9)]
    timed = link_clock(run, 0.25)
    assert [e[1] for e in timed["evaluations"]] == pytest.approx([2.8, 5.3])
    assert [e[2] for e in timed["evaluations"]] == [0.5, 0.9]
    assert run["evaluations"][0][1] == 1.3  # the stored run is left as it was


def test_lstm_perplexity_lower_is_better_on_loopback() -> None:
    s = score_setup(lstm_loopback(), "lstm-text", None)
    assert s.bar == pytest.approx(5.15)
    assert not s.higher_is_better
    assert s.row("cf100").reached == 0  # fastest, never within 3% of dense's perplexity
    assert s.yardstick == "cf10"
    # loopback: every time is the run's own clock (cf10 20 x 0.2 s, default 30 x 0.1 s)
    assert s.row("cf10").reaches[0].seconds == pytest.approx(4.0)
    assert s.row("default").ratios == pytest.approx((0.75, 0.75, 0.75))


def test_a_missing_study_names_it_and_unfinished_setups_are_left_out() -> None:
    studies = vgg_1gbit()
    with pytest.raises(ValueError, match="no timing study of vgg-digits on 1gbit"):
        score_setup([s for s in studies if s["role"] != "timing"], "vgg-digits", "1gbit")
    stored = stored_scoreboard(studies, "vgg-digits@1gbit,vgg-digits@100mbit")
    assert [s.setup for s in score(stored)] == ["vgg-digits@1gbit"]
    table = format_scoreboard(stored)
    assert "- not finished (their studies are not all stored): vgg-digits@100mbit" in table
    assert "| vgg-digits@100mbit |" not in table


def test_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stored = stored_scoreboard(vgg_1gbit() + lstm_loopback(), "vgg-digits@1gbit,lstm-text@loopback")
    table = format_scoreboard(stored)
    assert "| vgg-digits@1gbit | test accuracy >= 0.9800 | cf10, 4.0 s |" in table
    assert "| lstm-text@loopback | test perplexity <= 5.1500 | cf10, 4.0 s |" in table
    assert "| paper | search | 6.0 (6.0-–) | 1.50 (1.50-–) | no (2/3) |" in table
    assert "| cf100 | static | 1.0 (1.0-–) | 0.25 (0.25-–) | no (2/3) |" in table
    assert (
        "a run of 30 steps on that link (the same seed, just before that seed's searches)" in table
    )
    assert "on loopback in the ladder's study, each seed's after its static CFs" in table
    # a scoreboard stored before the searches trained seed by seed beside the static CFs
    before = {k: v for k, v in stored["scoreboard"].items() if k != "interleaved"}
    old_table = format_scoreboard({**stored, "scoreboard": {**before, "timing_seed": 0}})
    assert "a run of 30 steps on that link (seed 0)" in old_table
    assert "ladder's study" not in old_table
    assert "seeds 0, 1, 2\n" in table  # a constant learning rate
    decayed = {**stored["scoreboard"], "lr_milestones": [150, 250], "lr_gamma": 0.1}
    assert "seeds 0, 1, 2; the learning rate x 0.1 after steps 150, 250\n" in format_scoreboard(
        {**stored, "scoreboard": decayed}
    )
    # rebuilt by the command line, without training
    path = tmp_path / "scoreboard.json"
    path.write_text(json.dumps(stored))
    assert main(["compare", "--scoreboard", "--from-json", str(path)]) == 0
    assert capsys.readouterr().out == table + "\n"


def test_each_search_against_the_static_cf_it_sent_most() -> None:
    """Per seed, the CF a search sent at the most steps (of a tie the highest; none where it
    logged no CF), and its time to the bar over that static CF's on the same seed: on
    vgg_1gbit every search sends CF 10; on seed 1 'default' sends CF 40 most, which is not on
    the ladder."""
    assert sent_most({"cf_sent_by_step": [1000.0, 10.0, 160.0, None, 160.0, 10.0]}) == 160.0
    assert sent_most({"cf_sent_by_step": [None, None]}) is None
    assert sent_most({}) is None
    studies = vgg_1gbit()
    run = next(
        r for r in studies[3]["summary"]["runs"] if (r["variant"], r["seed"]) == ("default", 1)
    )
    run["cf_sent_by_step"] = [10.0, 10.0] + [40.0] * (len(run["cf_sent_by_step"]) - 2)
    stored = stored_scoreboard(studies, "vgg-digits@1gbit")
    (s,) = score(stored)
    assert s.sent == {"default": ("cf10", None, "cf10"), "paper": ("cf10", "cf10", "cf10")}
    # default at the bar in 3.0 s on its own clock, cf10 in 4.0 s on the link
    mine = versus_sent(s, "default")
    assert mine[0] == mine[2] == 0.75 and math.isnan(mine[1])
    assert versus_sent(s, "paper") == [1.5, 1.5, math.inf]  # paper misses seed 2, cf10 not
    table = format_scoreboard(stored)
    assert "| vgg-digits@1gbit | default | cf10, –, cf10 | 0.75 |" in table
    assert "| vgg-digits@1gbit | paper | cf10, cf10, cf10 | 1.50 (1.50-–) |" in table


def test_the_plan_trains_dense_and_the_ladder_once_and_the_searches_on_each_link() -> None:
    base = CompareConfig(steps=20, eval_every=5, delay="1ms", bandwidth="1gbit")
    setups = parse_setups("tiny-digits@1gbit,tiny-digits@loopback,tiny-digits@100mbit")
    searches = (parse_variant("default=topk:exponential"),)
    planned = plan(Inputs(base, setups, (10.0, 100.0), searches, (0, 1), 8))
    # on each shaped link, each seed's timing run just before its searches
    assert [(p.role, p.link) for p in planned] == [
        ("dense", None),
        (INTERLEAVED, None),
        *[
            (r, link)
            for link in ("1gbit", "100mbit")
            for _ in (0, 1)
            for r in ("timing", "searches")
        ],
    ]
    assert [p.study.seeds for p in planned[2:6]] == [(0,), (0,), (1,), (1,)]
    dense, ladder, timing, searching = (p.study for p in planned[:4])
    assert (dense.config.modes, dense.config.steps, dense.config.bandwidth) == (("ddp",), 20, None)
    statics = ladder_variants((10.0, 100.0))
    assert (ladder.config.steps, ladder.variants) == (40, (*statics, *searches))
    assert planned[1].ladder == ("cf10", "cf100")
    # the loopback searches train after each seed's static CFs, not after the whole ladder
    assert [(j.seed, j.variant.label) for j in ladder.jobs() if j.variant] == [
        (seed, label) for seed in (0, 1) for label in ("cf10", "cf100", "default")
    ]
    assert dense.config.delay is None and ladder.config.delay is None
    assert (timing.config.modes, timing.config.steps) == (("ddp", "gravac"), 8)
    assert (timing.config.eval_every, timing.config.delay) == (8, "1ms")
    assert (searching.config.steps, searching.variants) == (40, searches)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--setups", "vgg-digits@1gbit"], "--setups applies only with --scoreboard"),
        (["--from-json", "x.json"], "--from-json applies only with --scoreboard"),
        (["--report", "x.md"], "--report applies only with --scoreboard"),
        (["--twins"], "--twins applies only with --scoreboard"),
        (["--scoreboard", "--from-json", "x.json", "--twins"], "--twins does not apply"),
        (
            ["--scoreboard", "--workload", "lstm-text"],
            "--workload does not apply with --scoreboard",
        ),
        (["--scoreboard", "--quick"], "--quick does not apply with --scoreboard"),
        (["--scoreboard", "--from-json", "x.json", "--steps", "5"], "--steps does not apply"),
        (["--scoreboard", "--setups", "vgg-digits"], "--setups: 'vgg-digits' is not WORKLOAD@LINK"),
        (["--scoreboard", "--setups", "mnist@1gbit"], "WORKLOAD one of ['vgg-digits'"),
        (["--scoreboard", "--setups", "vgg-digits@fast"], "--setups: 'vgg-digits@fast'"),
        (["--scoreboard", "--setups", "vgg-digits@1gbit,vgg-digits@1gbit"], "more than once"),
        (["--scoreboard", "--ladder", "10,x"], "--ladder must be distinct comma-separated CFs"),
        (["--scoreboard", "--ladder", "0.5"], "--ladder '0.5': CF 0.5"),
        (["--scoreboard", "--timing-steps", "5"], "--timing-steps (5) must exceed --timing-warmup"),
        (["--scoreboard", "--variant", "cf10=topk:exponential"], "label 'cf10' is taken"),
        (["--scoreboard", "--from-json", "no/such.json"], "--from-json 'no/such.json': cannot"),
    ],
)
def test_bad_scoreboard_option_exits_2_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_baselines_are_rows_of_their_own_and_leave_the_bar_to_dense() -> None:
    s = score_setup(vgg_1gbit_with_baselines(), "vgg-digits", "1gbit")
    assert s.bar == pytest.approx(0.98)  # dense DDP's alone: the fp16 hook ends at 0.98
    kinds = [(r.label, r.kind) for r in s.rows]
    assert kinds[-2:] == [("ddp-fp16", "baseline"), ("accordion", "baseline")]
    assert ("paper", "search") in kinds and ("default", "search") in kinds
    fp16, accordion, default = s.row("ddp-fp16"), s.row("accordion"), s.row("default")
    assert [r.seconds for r in fp16.reaches] == [pytest.approx(6.0)] * 3  # timed on the link
    assert [r.seconds for r in accordion.reaches] == [pytest.approx(7.5)] * 2 + [None]
    # the default (3 s a seed) against them, seed by seed; 0 where only it reached the bar
    assert versus(default.reaches, fp16.reaches) == pytest.approx([0.5] * 3)
    assert versus(default.reaches, accordion.reaches) == pytest.approx([0.4, 0.4, 0.0])
    assert versus(accordion.reaches, default.reaches)[2] == math.inf
    missing = [Reach(5, 1.0, 10, 1.0, 0.99), Reach(2, None, None, None, 0.9)]
    assert all(math.isnan(v) for v in versus(missing, accordion.reaches))


def test_the_table_sets_the_default_against_the_baselines() -> None:
    studies = vgg_1gbit_with_baselines()
    searches = (parse_variant("default=topk:exponential"),)
    inputs = Inputs(CompareConfig(steps=2 * EVERY), parse_setups("vgg-digits@1gbit"), (10.0, 100.0),
                    searches, SEEDS, 30, baselines=True)  # fmt: skip
    table = format_scoreboard({"scoreboard": settings(inputs), "studies": studies})
    assert "- baselines: DDP with PyTorch's fp16 hook" in table
    header = "| setup | time vs ddp | MB, ddp / default | time vs ddp-fp16 | MB, ddp-fp16 / default"
    assert header in table
    # ddp: 10 s, 20 MB; fp16: 6 s, 20 MB; accordion: 7.5 s and 30 MB on two seeds of three
    assert (
        "| vgg-digits@1gbit | 0.30 | 1.00 | 0.50 | 1.00 | 0.40 (0.00-0.40) | 1.50 (1.50-–) |"
        in table
    )
    assert "| accordion | baseline | 7.5 (7.5-–) | 1.88 (1.88-–) | no (2/3) |" in table


def test_the_plan_with_the_baselines() -> None:
    base = CompareConfig(steps=20, eval_every=5, bandwidth="1gbit")
    searches = (parse_variant("default=topk:exponential"),)
    inputs = Inputs(base, parse_setups("tiny-digits@1gbit"), (10.0,), searches, (0,), 8, True)
    dense, _, timing, searching = (p.study for p in plan(inputs))
    assert dense.config.modes == ("ddp", "ddp-fp16")
    assert timing.config.modes == ("ddp", "ddp-fp16", "gravac")
    assert searching.variants == (*searches, parse_variant(ACCORDION))
    assert settings(inputs)["baselines"] is True
    taken = (parse_variant("accordion=topk:exponential"),)
    with pytest.raises(ValueError, match="label 'accordion' is taken by the ladder, dense DDP or"):
        plan(Inputs(base, parse_setups("tiny-digits@1gbit"), (10.0,), taken, (0,), 8, True))
