"""``scripts/variant_excess.py``: each variant's final metric against dense DDP's, seed by seed."""

from __future__ import annotations

from typing import Any

from tests.helpers import load_script


def _run(mode: str, variant: str | None, seed: int, final: float, wire: int) -> dict[str, Any]:
    return {
        "mode": mode,
        "variant": variant,
        "seed": seed,
        "final_metric": final,
        "wire_bytes_per_step": wire,
        "dense_wire_bytes_per_step": 1000,
    }


def _study(metric: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"workload": {"metric": metric}, "runs": runs}


def test_a_perplexity_is_judged_relative_to_dense_ddp_on_the_same_seed() -> None:
    rows = load_script("variant_excess").rows
    runs = [
        _run("gravac", "thc", 1, 6.0, 200),
        _run("ddp", None, 0, 4.0, 1000),
        _run("ddp", None, 1, 5.0, 1000),
        _run("gravac", "thc", 0, 4.2, 250),
    ]
    assert rows(_study("test perplexity", runs)) == [
        "| thc | 4.2000 / 6.0000 | +5.0% / +20.0% | 4.5x |",
        "| ddp | 4.0000 / 5.0000 | +0.0% / +0.0% | 1.0x |",
    ]


def test_an_accuracy_is_judged_in_points_and_a_seed_without_dense_ddp_is_not_judged() -> None:
    rows = load_script("variant_excess").rows
    runs = [_run("ddp", None, 0, 0.98, 1000), _run("gravac", "cf10", 0, 0.97, 200)]
    runs.append(_run("gravac", "cf10", 2, 0.99, 200))
    want = "| cf10 | 0.9700 / 0.9900 | -0.0100 / - | 5.0x |"
    assert rows(_study("test accuracy", runs))[1] == want
