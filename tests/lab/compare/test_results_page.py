"""The results page from made-up stored scoreboards: its summary, its goals judged, its
sections and figures; from the command line, with several stored scoreboards."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gravac.cli import main
from gravac_lab.compare.results_page import (
    PLOTS,
    READING,
    Goal,
    goals,
    link_bound,
    page_setups,
    write_page,
)
from tests.lab.compare.scoreboard_made_up import (
    lstm_loopback,
    stored_scoreboard,
    vgg_1gbit_with_baselines,
)


def _boards() -> list[dict[str, Any]]:
    return [
        stored_scoreboard(vgg_1gbit_with_baselines(), "vgg-digits@1gbit"),
        stored_scoreboard(lstm_loopback(), "lstm-text@loopback"),
    ]


def test_the_summary_sets_the_default_against_every_baseline(tmp_path: Path) -> None:
    page = tmp_path / "RESULTS.md"
    written = write_page(_boards(), page, draw=False)
    assert written == [page]
    text = page.read_text()
    # vgg: the default 3 s a seed; DDP 10 s, the fp16 hook 6 s, Accordion 7.5 s on 2 seeds of 3
    # (0 on the third: only the default reached the bar), the yardstick cf10 4 s, Algorithm 1
    # 1.5x it on 2 seeds; Accordion 30 MB to the bar against the default's 20
    assert (
        "| vgg-digits@1gbit, 2 workers | test accuracy >= 0.9800 | cf10, 4.0 s | 3.0, 3/3 "
        "| 0.30 | 0.50 | 0.40 | 0.75 | 1.50 | 1.50 |" in text
    )
    # lstm on loopback ran no baselines; its made-up DDP never held the bar (0: only the default)
    assert "| lstm-text@loopback, 2 workers | test perplexity <= 5.1500 | cf10, 4.0 s |" in text
    assert "| 3.0, 3/3 | 0.00 | – | – | 0.75 | – | – |" in text
    assert "Not yet run: vgg-digits@100mbit, 2 workers; resnet-digits@1gbit, 2 workers" in text
    assert "## vgg-digits@1gbit, 2 workers" in text and "## lstm-text@loopback, 2 workers" in text
    assert "| accordion | 0.40 (0.00-0.40) | 1.50 (1.50-–) |" in text
    assert "Trained by a command not stored (the scoreboard predates it)." in text
    assert "![" not in text  # no figures drawn
    # the setups in the page's order, whatever the stored scoreboards' order
    write_page(_boards()[::-1], page, draw=False)
    assert page.read_text() == text
    # a hand-written reading of the goals follows their table
    (tmp_path / READING).parent.mkdir(parents=True)
    (tmp_path / READING).write_text("### Why\n\nAccordion sends fewer bytes.\n")
    write_page(_boards(), page, draw=False)
    read = page.read_text()
    assert read.index("| goal | setup |") < read.index("### Why\n\nAccordion sends fewer")
    assert read.index("Accordion sends fewer bytes.") < read.index("## vgg-digits@1gbit")


def test_the_goals_are_judged_on_the_median_ratio() -> None:
    vgg, lstm = page_setups(_boards())
    assert link_bound(vgg)  # its made-up DDP spends 0.6 of a step communicating
    assert goals([vgg, lstm]) == [
        Goal("time <= 0.67x Accordion's", "vgg-digits@1gbit, 2 workers", 0.4, True),
        Goal("MB >= 10x fewer than Accordion", "vgg-digits@1gbit, 2 workers", 1.5, False),
        Goal("time <= 0.8x DDP + fp16 hook's (link-bound)", "vgg-digits@1gbit, 2 workers",
             0.5, True),
    ]  # fmt: skip


def test_a_link_that_is_not_the_bottleneck_has_no_fp16_goal() -> None:
    studies = vgg_1gbit_with_baselines()
    timing = studies[2]["summary"]["runs"]
    ddp = next(r for r in timing if r["mode"] == "ddp")
    ddp["comm_seconds"] = 0.1 * ddp["step_seconds"]
    (vgg,) = page_setups([stored_scoreboard(studies, "vgg-digits@1gbit")])
    assert not link_bound(vgg)
    assert [g.goal for g in goals([vgg])] == [
        "time <= 0.67x Accordion's",
        "MB >= 10x fewer than Accordion",
    ]


def test_a_default_that_misses_the_bar_on_a_seed_is_not_judged() -> None:
    studies = vgg_1gbit_with_baselines()
    searches = studies[3]["summary"]["runs"]
    default = next(r for r in searches if r["variant"] == "default" and r["seed"] == 2)
    default["evaluations"] = [[s, t, 0.9] for s, t, _ in default["evaluations"]]
    (vgg,) = page_setups([stored_scoreboard(studies, "vgg-digits@1gbit")])
    assert {g.met for g in goals([vgg])} == {None}


@pytest.mark.slow  # matplotlib's font cache asks fc-list
def test_the_figures_are_drawn_beside_the_page_and_linked(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "RESULTS.md"
    page.parent.mkdir()
    written = write_page(_boards(), page)
    folder = page.parent / PLOTS / "vgg-digits-1gbit-2w"
    for name in ("metric_time.png", "metric_bytes.png", "cf_steps.png", "cf_density.png"):
        assert folder / name in written
        assert (folder / name).read_bytes()[:4] == b"\x89PNG"
    text = page.read_text()
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert len(links) == 8  # four a setup
    assert all((page.parent / link).is_file() for link in links)


def test_two_scoreboards_of_one_setup_are_refused() -> None:
    board = stored_scoreboard(lstm_loopback(), "lstm-text@loopback")
    with pytest.raises(ValueError, match="two stored scoreboards hold lstm-text@loopback, 2 work"):
        page_setups([board, board])


@pytest.mark.slow
def test_the_command_line_reads_several_scoreboards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for i, board in enumerate(_boards()):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(board))
    page = tmp_path / "RESULTS.md"
    argv = ["compare", "--scoreboard", "--from-json", *map(str, paths), "--report", str(page)]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "### vgg-digits@1gbit" in out.out and "### lstm-text@loopback" in out.out
    assert f"gravac compare: wrote {page}" in out.err
    assert "## Goals" in page.read_text()
