"""``examples/train_digits.py`` under torchrun (2 gloo processes on loopback)."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import torchrun_command

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
#: clean torchrun exits each front end must show: before the fixes, 2 of 6 runs aborted at
#: exit (the optimizer), and 5 of 37 (the DDP hook: gravac.release_group)
EXIT_RUNS = 5


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """The example on 2 processes, with ``args``; never raises on a failed run."""
    command = torchrun_command(EXAMPLE, *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _wire_bytes(stdout: str) -> tuple[int, int]:
    """The bytes sent and dense fp32's, as the example prints them."""
    sent, dense = stdout.split("wire bytes ")[1].split(" (dense fp32 ")
    return int(sent.replace(",", "")), int(dense.split(")")[0].replace(",", ""))


@pytest.fixture(scope="module")
def hook_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """The DDP hook's two training runs, shared by their tests and the exit-path test."""
    tmp = tmp_path_factory.mktemp("hook")
    trains = ("--max-steps", "60", "--ddp-hook", "--log-dir", str(tmp / "tb"))
    # ``--policy fixed --cf 100`` through the hook
    fixed = ("--policy", "fixed", "--cf", "100", "--ddp-hook", "--max-steps", "20")
    return {
        "trains": (tmp / "tb", _torchrun(*trains)),
        "fixed": (tmp / "tb-fixed", _torchrun(*fixed, "--log-dir", str(tmp / "tb-fixed"))),
    }


@pytest.mark.slow
def test_torchrun_example_trains(tmp_path: Path) -> None:
    out = _torchrun("--max-steps", "60", "--log-dir", str(tmp_path / "tb"))
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy = float(out.stdout.split("test accuracy")[1].split()[0])
    assert accuracy > 0.5  # 60 steps from scratch: well above chance (0.1)
    assert "wire bytes" in out.stdout
    assert any((tmp_path / "tb").iterdir())


@pytest.mark.slow
def test_torchrun_example_trains_with_the_ddp_hook(
    hook_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    log_dir, out = hook_runs["trains"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split("test accuracy")[1].split()[0]) > 0.5
    sent, dense = _wire_bytes(out.stdout)
    assert sent < dense
    assert any(log_dir.iterdir())


@pytest.mark.slow
def test_a_fixed_cf_is_given_on_the_command_line(
    hook_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    """``--policy fixed --cf 100`` through the hook: 1/100 of the weights' elements sent as a
    value and an int32 index each (1/50 of their bytes), the biases dense: a little more than
    1/50 of the dense bytes."""
    _, out = hook_runs["fixed"]
    assert out.returncode == 0, out.stderr[-2000:]
    sent, dense = _wire_bytes(out.stdout)
    assert 30 < dense / sent < 50


@pytest.mark.parametrize("args", [("--policy", "fixed"), ("--cf", "100")])
def test_a_cf_without_the_fixed_policy_or_the_reverse_is_refused(
    args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line is checked before the process group is joined: run in this process."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert exc.value.code == 2
    assert "--cf goes with --policy fixed and only there" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("front", [("--compressor", "thc"), ("--ddp-hook",)], ids=["opt", "ddp"])
def test_torchrun_exit_path_is_clean_every_time(
    tmp_path: Path,
    front: tuple[str, ...],
    hook_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    """``EXIT_RUNS`` runs of each front end; the DDP hook's two training runs count as two."""
    outs = [out for _, out in hook_runs.values()] if front == ("--ddp-hook",) else []
    for run in range(len(outs), EXIT_RUNS):
        outs.append(_torchrun("--max-steps", "10", *front, "--log-dir", str(tmp_path / f"tb{run}")))
    assert len(outs) == EXIT_RUNS
    for run, out in enumerate(outs):
        assert out.returncode == 0, f"run {run}: {out.stderr[-2000:]}"
        assert "terminate called" not in out.stderr
