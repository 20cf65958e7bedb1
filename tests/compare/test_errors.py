"""``gravac compare`` rejects bad options with status 2 and a message naming the option."""

from __future__ import annotations

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
    ],
)
def test_bad_option_exits_2_naming_it(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2
    assert option in capsys.readouterr().err
