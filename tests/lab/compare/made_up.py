"""Made-up run summaries and a study's summary built from them, for the pure parts' tests."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gravac_lab.compare.aggregate import aggregate
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.report import ModeSummary
from gravac_lab.compare.study import Study, parse_variant

#: the study the made-up summary describes: ddp and two gravac variants, two seeds
CONFIG = CompareConfig(modes=("ddp", "gravac"), workload="tiny-digits", steps=4, timing_warmup=1)
VARIANTS = (parse_variant('cf100=topk:fixed{"cf": 100}'), parse_variant("topk:exponential"))
SEEDS = (0, 1)
#: parameters of the made-up model, and its float32 bytes a step
PARAMETERS = 100
DENSE_BYTES = 4 * PARAMETERS


def run(
    mode: str = "gravac", variant: str | None = "cf100", seed: int = 0, **fields: Any
) -> ModeSummary:
    """A run of 4 steps evaluated at steps 2 and 4; ``fields`` replace the defaults."""
    gravac = mode == "gravac"
    defaults: dict[str, Any] = {
        "mode": mode,
        "steps": 4,
        "timed_from": 2,
        "step_seconds": 0.1,
        "forward_backward_seconds": 0.05,
        "compute_seconds": 0.04,
        "compress_seconds": 0.01 if gravac else None,
        "comm_seconds": 0.02,
        "comm_source": "record" if gravac else "exposed",
        "other_seconds": 0.03,
        "wire_bytes": 4 * (10 if gravac else DENSE_BYTES),
        "wire_bytes_per_step": 10 if gravac else DENSE_BYTES,
        "dense_wire_bytes_per_step": DENSE_BYTES,
        "parameters": PARAMETERS,
        "final_metric": 0.9,
        "target": 0.95,
        "time_to_target_seconds": None,
        "steps_to_target": None,
        "evaluations": [(2, 1.0, 0.5), (4, 2.0, 0.9)],
        "options": {"overlap": True} if gravac else {},
        "variant": variant if gravac else None,
        "seed": seed,
        "ranks_agree": True if gravac else None,
        "wire_bytes_by_step": [10 if gravac else DENSE_BYTES] * 4,
        "cf_sent_by_step": [10.0, 10.0, 20.0, 20.0] if gravac else [None] * 4,
        "cf_achieved_by_step": [9.5, 9.5, 19.0, 19.0] if gravac else [None] * 4,
    }
    return ModeSummary(**{**defaults, **fields})


def runs() -> list[ModeSummary]:
    """Every run of the study, seeds outermost as the runner orders them; runs differ by seed
    in their final metric (binary fractions: medians are exact) and time to target."""
    out = []
    for seed in SEEDS:
        out.append(
            run(
                "ddp",
                None,
                seed,
                final_metric=0.9375 + seed / 16,
                time_to_target_seconds=2.0,
                steps_to_target=4,
            )
        )
        out.append(
            run("gravac", "cf100", seed, final_metric=0.75 - seed / 4, cf_sent_by_step=[100.0] * 4)
        )
        out.append(
            run(
                "gravac",
                "topk-exponential",
                seed,
                final_metric=0.97,
                time_to_target_seconds=1.0 + seed,
                steps_to_target=2 + 2 * seed,
            )
        )
    return out


def summary(summaries: list[ModeSummary] | None = None) -> dict[str, Any]:
    """What :func:`gravac_lab.compare.runner.run_compare` returns for ``summaries`` (default
    :func:`runs`), on loopback."""
    summaries = runs() if summaries is None else summaries
    return {
        "config": CONFIG.resolved(),
        "study": Study(CONFIG, VARIANTS, SEEDS).to_dict(),
        "workload": {
            "name": CONFIG.workload,
            "summary": "made up",
            "parameters": PARAMETERS,
            "metric": "test accuracy",
            "target": 0.95,
        },
        "network": {"shaped": False, "description": "loopback (not shaped)", "note": None},
        "runs": [asdict(s) for s in summaries],
        "aggregates": [asdict(a) for a in aggregate(summaries)],
        "host": {"cpus": 2, "load_before": 0.5, "load_after": 1.5},
        "seconds": 1.0,
    }
