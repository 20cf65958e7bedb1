"""``gravac compare`` rejects bad options with status 2 and a message naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from gravac.cli import main


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--modes", "ddp,horovod"], "--modes"),
        (["--modes", ","], "--modes"),
        (["--bandwidth", "fast"], "--bandwidth"),
        (["--bandwidth", "1gb"], "--bandwidth"),
        (["--delay", "soon", "--bandwidth", "1gbit"], "--delay"),
        (["--delay", "1ms"], "--delay"),
        (["--policy-options", "{cf: 100}"], "--policy-options"),
        (["--policy", "fixed"], "--policy-options"),
        (["--workers", "1"], "--workers"),
        (["--steps", "3", "--timing-warmup", "5"], "--steps"),
        (["--workload", "mnist"], "--workload"),
        (["--variant", "topk"], "--variant 'topk': expected ':'"),
        (["--variant", "x=foo:fixed"], "--variant 'x=foo:fixed': compressor must be one of"),
        (["--variant", "topk:fixed"], "needs option 'cf'"),
        (["--variant", "topk:exponential", "--variant", "topk:exponential"], "name more"),
        (["--variant", "topk:exponential", "--modes", "ddp"], "--variant needs a mode"),
        (["--variant", "topk:exponential", "--policy", "fixed"], "--policy applies only"),
        (["--variant", "topk:exponential", "--compressor-options", "{}"], "--compressor-options"),
        (["--seeds", "0,0"], "--seeds must be distinct integers >= 0"),
        (["--seeds", "a"], "--seeds"),
        (["--target", "5"], "--target must be an accuracy in (0, 1] for vgg-digits"),
        (["--workload", "lstm-text", "--target", "0.9"], "--target must be a perplexity > 1"),
        (["--stop-at", "1.5"], "--stop-at must be an accuracy in (0, 1] for vgg-digits"),
        (["--workload", "lstm-text", "--stop-at", "1"], "--stop-at must be a perplexity > 1"),
        (["--out", "no/such/folder/x.json"], "no/such/folder/x.json: its folder"),
        (["--csv", "no/such/folder/x.csv"], "no/such/folder/x.csv: its folder"),
        (["--lr-milestones", "20,10"], "--lr-milestones must be increasing steps >= 1"),
        (["--lr-milestones", "0"], "--lr-milestones must be increasing steps >= 1"),
        (["--lr-milestones", "a"], "--lr-milestones must be increasing steps >= 1"),
        (["--lr-gamma", "0"], "--lr-gamma must be in (0, 1], got 0.0"),
        (["--lr-gamma", "nan"], "--lr-gamma must be a finite number"),
        (["--scoreboard", "--report", "no/such/folder/RESULTS.md"], "RESULTS.md: its folder"),
        (["--nodes", "0"], "--nodes must be an integer >= 1, got '0'"),
        (["--nodes", "-2"], "--nodes must be an integer >= 1, got '-2'"),
        (["--nodes", "two"], "--nodes must be an integer >= 1, got 'two'"),
        (["--ranks-per-node", "0"], "--ranks-per-node must be an integer >= 1, got '0'"),
        (["--ranks-per-node", "1.5"], "--ranks-per-node must be an integer >= 1, got '1.5'"),
        (["--workers", "x"], "--workers must be an integer >= 1, got 'x'"),
        (
            ["--workers", "3", "--nodes", "2", "--ranks-per-node", "2"],
            "--workers 3 disagrees with --nodes 2 x --ranks-per-node 2 = 4 workers",
        ),
        (["--workers", "5", "--nodes", "2"], "--workers 5 is not a multiple of --nodes 2"),
        (
            ["--workers", "4", "--ranks-per-node", "3"],
            "--workers 4 is not a multiple of --ranks-per-node 3",
        ),
        (
            ["--nodes", "1", "--ranks-per-node", "1"],
            "--nodes 1 --ranks-per-node 1: 1 worker in all; a run needs 2 or more",
        ),
        (["--workers", "1"], "--workers 1: 1 worker in all"),
        (["--optimizer", "lamb"], "--optimizer: invalid choice: 'lamb'"),
    ],
)
def test_bad_option_exits_2_naming_it(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_plots_must_name_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "plots"
    a_file.write_text("")
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--plots", str(a_file)])
    assert exc.value.code == 2
    assert f"--plots must name a directory, got {str(a_file)!r}" in capsys.readouterr().err
