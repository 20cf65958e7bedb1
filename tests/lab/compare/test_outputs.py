"""A study's outputs from made-up runs: the JSON, the CSV, the markdown table and the plots."""

from __future__ import annotations

import csv
import json
import struct
from dataclasses import asdict
from pathlib import Path

import pytest

from gravac_lab.compare import plots
from gravac_lab.compare.export import CSV_COLUMNS, write_csv, write_json
from gravac_lab.compare.report import format_table
from tests.lab.compare import made_up

#: the first bytes of every PNG file
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: a drawn figure's PNG is tens of kB; an empty canvas would be a few hundred bytes
MIN_PNG_BYTES = 5000


def test_csv_has_one_row_a_run_and_every_scalar_figure(tmp_path: Path) -> None:
    summary = made_up.summary()
    write_csv(summary, tmp_path / "runs.csv")
    with (tmp_path / "runs.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["variant"], r["seed"]) for r in rows] == [
        ("ddp", "", "0"),
        ("gravac", "cf100", "0"),
        ("gravac", "topk-exponential", "0"),
        ("ddp", "", "1"),
        ("gravac", "cf100", "1"),
        ("gravac", "topk-exponential", "1"),
    ]
    assert list(rows[0]) == list(CSV_COLUMNS)
    scalars = [k for k, v in asdict(made_up.run()).items() if not isinstance(v, list | dict)]
    assert set(CSV_COLUMNS) == set(scalars)  # every figure, no list or options
    exp1 = rows[5]
    assert float(exp1["time_to_target_seconds"]) == 2.0
    assert int(exp1["steps_to_target"]) == 4
    assert exp1["ranks_agree"] == "True"
    assert float(rows[4]["final_metric"]) == 0.5
    assert rows[4]["time_to_target_seconds"] == ""  # not reached
    assert rows[0]["compress_seconds"] == rows[0]["ranks_agree"] == ""  # DDP has neither


def test_json_holds_everything(tmp_path: Path) -> None:
    summary = made_up.summary()
    write_json(summary, tmp_path / "study.json")
    back = json.loads((tmp_path / "study.json").read_text())
    assert back["study"]["seeds"] == [0, 1]
    assert [v["label"] for v in back["study"]["variants"]] == ["cf100", "topk-exponential"]
    assert len(back["runs"]) == 6
    assert back["runs"][1]["cf_sent_by_step"] == [100.0] * 4
    assert back["runs"][2]["cf_sent_by_step"] == [10.0, 10.0, 20.0, 20.0]
    assert back["runs"][0]["wire_bytes_by_step"] == [made_up.DENSE_BYTES] * 4
    assert back["aggregates"][2]["figures"]["time_to_target_seconds"] == {
        "median": 1.5,
        "min": 1.0,
        "max": 2.0,
    }


def test_table_has_a_row_a_mode_and_variant_with_median_and_range() -> None:
    table = format_table(made_up.summary())
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3  # header, ddp, two variants
    assert rows[0].startswith("| mode | variant | step ms |")
    assert "| reached 0.95 | steps to 0.95 | time to 0.95 (s) | final test accuracy |" in rows[0]
    ddp, cf100, exp = rows[1:]
    assert ddp.startswith("| ddp | – | 100.0 |")
    assert ddp.endswith("| 2/2 | 4 | 2.0 | 0.9688 (0.9375-1.0000) |")
    assert cf100.startswith("| gravac | cf100 | 100.0 |")
    assert cf100.endswith("| 0/2 | not reached | not reached | 0.6250 (0.5000-0.7500) |")
    assert exp.endswith("| 2/2 | 3 (2-4) | 1.5 (1.0-2.0) | 0.9700 |")
    assert """cf100 = `topk:fixed{"cf": 100}`; topk-exponential = `topk:exponential`""" in table
    assert "- seeds 0, 1: every figure is the median over the seeds" in table
    assert "ranks sent at different CFs" not in table


def test_table_says_how_ddp_held_its_gradients() -> None:
    summary = made_up.summary()
    assert "- DDP's gradient_as_bucket_view: True" in format_table(summary)
    del summary["config"]["bucket_view"]  # a summary from before the option: DDP's default
    assert "- DDP's gradient_as_bucket_view: False" in format_table(summary)
    gravac_only = made_up.summary([r for r in made_up.runs() if r.mode == "gravac"])
    assert "gradient_as_bucket_view" not in format_table(gravac_only)


def test_table_names_the_optimizer() -> None:
    summary = made_up.summary()
    lr = summary["config"]["lr"]
    assert f"SGD lr {lr:g} momentum 0.9," in format_table(summary)
    summary["config"]["optimizer"] = "adam"
    assert f"Adam lr {lr:g}," in format_table(summary)
    del summary["config"]["optimizer"]  # a summary from before the option: SGD
    assert f"SGD lr {lr:g} momentum 0.9," in format_table(summary)


def test_table_names_the_machine_where_the_study_names_it() -> None:
    """A study's float results may differ between kinds of machine: the table says which ran it
    where the JSON holds it, and the line of an older JSON, which does not, reads as before."""
    summary = made_up.summary()
    assert "- host: 2 CPUs, 1-minute load average 0.50 before" in format_table(summary)
    summary["host"].update(cpu="AMD EPYC", torch_cpu="AVX512")
    expected = "- host: 2 CPUs (AMD EPYC, torch's CPU kernels: AVX512), 1-minute load average"
    assert expected in format_table(summary)
    summary["host"]["cpu"] = None  # not Linux
    assert "- host: 2 CPUs (torch's CPU kernels: AVX512), 1-minute" in format_table(summary)


def test_table_names_the_runs_whose_ranks_disagreed() -> None:
    runs = made_up.runs()
    runs[4] = made_up.run("gravac", "cf100", 1, ranks_agree=False)
    table = format_table(made_up.summary(runs))
    assert "- ! the ranks sent at different CFs in: gravac cf100 seed 1" in table


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header (its first chunk, IHDR), after checking it is one."""
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert len(data) > MIN_PNG_BYTES, f"{path.name}: {len(data)} bytes"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plots_are_written_as_png_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    directory = tmp_path / "new" / "plots"  # made if missing
    written = plots.write_plots(made_up.summary(), directory)
    assert sorted(p.name for p in written) == sorted(plots.PLOT_FILES.values())
    for path in written:
        width, height = _png_size(path)
        assert width > height > 0


def test_without_gravac_runs_only_the_metric_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ddp = [r for r in made_up.runs() if r.mode == "ddp"]
    written = plots.write_plots(made_up.summary(ddp), tmp_path)
    assert [p.name for p in written] == [
        plots.PLOT_FILES["metric_time"],
        plots.PLOT_FILES["metric_bytes"],
    ]
    for path in written:
        _png_size(path)
