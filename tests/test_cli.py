"""The ``gravac`` command line: parsing, JSON output of the benchmarks, errors."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from gravac import compressors
from gravac.cli import build_parser, main
from gravac.compressors.base import Multilevel

SMALL = ["--size", "4K", "--workers", "2", "--repeats", "1"]
ROW_KEYS = {
    "name",
    "input_gbps",
    "copy_gbps",
    "ratio_to_copy",
    "decompress_gbps",
    "ef_ratio",
    "nmse",
    "achieved_cf",
    "wire_bytes",
    "cf_requested",
    "size",
    "workers",
}
#: CF of the dense baselines regardless of the request (docs/design.md section 1).
DENSE_CF = {"none": 1.0, "fp16": 2.0, "bf16": 2.0}


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, Any]]:
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list)
    return rows


@pytest.fixture(scope="module")
def compressor_rows() -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "compressors", *SMALL, "--json"]) == 0
    rows = json.loads(out.getvalue())
    assert isinstance(rows, list)
    return rows


def test_bench_compressors_json_has_a_row_per_registered_compressor(
    compressor_rows: list[dict[str, Any]],
) -> None:
    assert [r["name"] for r in compressor_rows] == compressors.names()
    for r in compressor_rows:
        assert set(r) >= ROW_KEYS, f"{r['name']}: missing {sorted(ROW_KEYS - set(r))}"
        assert r["size"] == 4096
        assert r["workers"] == 2
        assert r["cf_requested"] == 100.0


def test_bench_compressors_values_are_plausible(compressor_rows: list[dict[str, Any]]) -> None:
    by_name = {r["name"]: r for r in compressor_rows}
    assert float(by_name["none"]["nmse"]) < 1e-12
    topk = by_name["topk"]
    assert 0.0 < float(topk["nmse"]) < 1.0
    assert float(topk["achieved_cf"]) == pytest.approx(100.0, rel=0.05)
    for name, cf in DENSE_CF.items():
        if name in by_name:
            assert by_name[name]["achieved_cf"] == cf
    for r in compressor_rows:
        achieved = float(r["achieved_cf"])
        assert 1.0 <= achieved <= 4096.0, r["name"]
        assert int(r["wire_bytes"]) > 0
        assert float(r["nmse"]) >= 0.0


def test_bench_compressors_subset_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _run_json(
        capsys, ["bench", "compressors", *SMALL, "--compressors", "topk,none", "--json"]
    )
    assert [r["name"] for r in rows] == ["topk", "none"]
    assert main(["bench", "compressors", *SMALL, "--compressors", "none", "--cf", "10"]) == 0
    table = capsys.readouterr().out
    assert "local_stats + compress" in table
    assert "copy_(src)" in table
    assert "\nnone " in table
    assert (
        main(["bench", "compressors", *SMALL, "--compressors", "none", "--subnormal", "0.5"]) == 0
    )
    assert "the last 0.5 of them times 2^-130 (subnormal)" in capsys.readouterr().out


def test_bench_multilevel_json(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _run_json(
        capsys, ["bench", "multilevel", "--size", "4K", "--repeats", "1", "--cf2", "100", "--json"]
    )
    supported = [n for n in compressors.names() if isinstance(compressors.create(n), Multilevel)]
    assert [r["name"] for r in rows] == supported
    for r in rows:
        assert {"name", "cf1", "cf2", "multilevel_s", "direct_s", "ratio"} <= set(r)
        assert r["cf1"] == 10.0 and r["cf2"] == 100.0
    assert main(["bench", "multilevel", "--size", "4K", "--repeats", "1", "--cf2", "100"]) == 0
    assert "ratio = direct / multi-level" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "compressors", "--size", "16Q"], "--size"),
        (["bench", "compressors", "--size", "0"], "--size"),
        (["bench", "multilevel", "--size", "-4K"], "--size"),
        (["bench", "compressors", "--cf", "0.5"], "--cf"),
        (["bench", "compressors", "--workers", "0"], "--workers"),
        (["bench", "compressors", "--subnormal", "1.5"], "--subnormal"),
        (["bench", "compressors", "--subnormal", "x"], "--subnormal"),
        (["bench", "compressors", "--repeats", "x"], "--repeats"),
        (["bench", "compressors", "--compressors", "nope"], "--compressors"),
        (["bench", "multilevel", "--cf1", "100", "--cf2", "10"], "--cf1"),
        (["bench", "multilevel", "--compressors", "none"], "multi-level"),
        (["bench"], "BENCHMARK"),
        ([], "COMMAND"),
    ],
)
def test_usage_errors_name_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_gravac() -> None:
    argv = ["bench", "compressors", "--size", "1K", "--workers", "1", "--repeats", "1"]
    argv += ["--compressors", "none", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "gravac", *argv], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["name"] == "none"


def test_bench_kernels_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "kernels", "--size", "1K"])
    assert exc.value.code == 2
    assert "needs a CUDA --device and CuPy" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ("--theta-min=0", "--theta-min must be"),
        ("--epsilon=2", "--epsilon must be"),
        ("--lr=nan", "--lr must be a number in (0, 3.403e+38], got nan"),
        ("--lr=1e308", "--lr must be a number in (0, 3.403e+38], got 1e+308"),
        ("--cf=100", "--cf 100 is the CF of --policy fixed; --policy exponential searches"),
        ("--policy=fixed --cf=0.5", "--policy fixed: fixed policy option cf must be a finite"),
    ],
)
def test_demo_rejects_bad_values_before_starting_workers(
    option: str, match: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused as a usage error before a worker starts (a launch in this test, not marked
    slow, would raise): 1e308 and a CF below 1 were raised from inside every worker."""
    log_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["demo", *option.split(), "--log-dir", str(log_dir)])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err
    assert not log_dir.exists()


def test_demo_refuses_a_log_dir_it_cannot_make_before_starting_workers(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was rank 0's FileNotFoundError, once the workers had started."""
    (tmp_path / "file").write_text("")
    log_dir = tmp_path / "file" / "run"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--log-dir", str(log_dir)])
    assert exc.value.code == 2
    assert f"--log-dir '{log_dir}' cannot be made: [Errno 20] Not a directory" in (
        capsys.readouterr().err
    )


def test_demo_help_shows_every_default() -> None:
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr,index]
    actions = [a for a in demo._actions if a.dest != "help"]
    assert all(a.help for a in actions), [a.dest for a in actions if not a.help]
    assert demo.format_help().count("(default:") == len(actions)


def test_bench_prints_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "compressors", "--size", "1K", "--compressors", "topk,fp16", "--json"]) == 0
    )
    err = capsys.readouterr().err
    assert "gravac bench: topk ..." in err and "gravac bench: fp16 ..." in err
