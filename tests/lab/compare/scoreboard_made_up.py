"""Made-up stored scoreboards (``gravac compare --scoreboard --out``'s JSON), for the pure parts'
tests: the scoreboard's judgement, its table and the results page."""

from __future__ import annotations

from typing import Any

from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.scoreboard_plan import Inputs, parse_setups, settings
from gravac_lab.compare.study import parse_variant

__all__ = [
    "EVERY",
    "SEEDS",
    "lstm_loopback",
    "made_run",
    "stored_scoreboard",
    "study",
    "vgg_1gbit",
    "vgg_1gbit_with_baselines",
]

#: steps between the made-up runs' evaluations
EVERY = 10
SEEDS = (0, 1, 2)


def made_run(
    variant: str | None,
    seed: int,
    metrics: list[float],
    step_seconds: float = 0.1,
    mode: str = "ddp",
    comm_share: float = 0.6,
) -> dict[str, Any]:
    """A stored run evaluated every EVERY steps, each step ``step_seconds`` (``comm_share`` of
    it communication not hidden) and 1 MB (a run of ``mode`` where ``variant`` is ``None``,
    else of gravac, sending CF 10 at every step)."""
    steps = EVERY * len(metrics)
    return {
        "mode": mode if variant is None else "gravac",
        "variant": variant,
        "seed": seed,
        "evaluations": [
            (EVERY * (i + 1), step_seconds * EVERY * (i + 1), m) for i, m in enumerate(metrics)
        ],
        "final_metric": metrics[-1],
        "wire_bytes_by_step": [1_000_000] * steps,
        "cf_sent_by_step": [None if variant is None else 10.0] * steps,
        "step_seconds": step_seconds,
        "comm_seconds": comm_share * step_seconds,
    }


def study(role: str, workload: str, link: str | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    network = {"description": "loopback (not shaped)" if link is None else f"{link} veth"}
    return {
        "role": role,
        "workload": workload,
        "link": link,
        "summary": {"runs": runs, "network": {**network, "note": None}},
    }


def vgg_1gbit() -> list[dict[str, Any]]:
    """vgg-digits on 1gbit: dense ends at 0.985 / 0.99 / 0.995 (bar 0.98); cf100 is the faster
    static but misses the bar on seed 2; the search 'default' beats cf10, 'paper' misses seed 2."""
    good = 0.985
    dense = [made_run(None, s, [0.9, 0.99, 0.985 + s / 200]) for s in SEEDS]
    cf10 = [made_run("cf10", s, [0.9, good, good, good]) for s in SEEDS]
    cf100 = [made_run("cf100", s, [good, good, 0.9, good]) for s in (0, 1)]
    cf100.append(made_run("cf100", 2, [good, 0.9, good, 0.9]))  # never two in a row
    timing = [
        made_run(None, 0, [0.5], 0.5),
        made_run("cf10", 0, [0.5], 0.2),
        made_run("cf100", 0, [0.5], 0.1),
    ]
    default = [made_run("default", s, [0.9, good, good, good], 0.15) for s in SEEDS]
    paper = [made_run("paper", s, [0.9, 0.9, good, good], 0.2) for s in (0, 1)]
    paper.append(made_run("paper", 2, [0.9, 0.9, 0.9, good], 0.2))  # reached only at the last
    return [
        study("dense", "vgg-digits", None, dense),
        study("ladder", "vgg-digits", None, cf10 + cf100),
        study("timing", "vgg-digits", "1gbit", timing),
        study("searches", "vgg-digits", "1gbit", default + paper),
    ]


def vgg_1gbit_with_baselines() -> list[dict[str, Any]]:
    """:func:`vgg_1gbit` with the baselines: the fp16 hook in the dense study (0.3 s a step on
    the link, at the bar from step 20: 6 s) and Accordion among the searches (its own clock:
    0.25 s a step, at the bar from step 30 on seeds 0 and 1, never on seed 2)."""
    good = 0.985
    studies = vgg_1gbit()
    dense, _, timing, searches = (s["summary"]["runs"] for s in studies)
    dense += [made_run(None, s, [0.9, 0.99, 0.98], mode="ddp-fp16") for s in SEEDS]
    timing.append(made_run(None, 0, [0.5], 0.3, mode="ddp-fp16"))
    searches += [made_run("accordion", s, [0.9, 0.9, good, good], 0.25) for s in (0, 1)]
    searches.append(made_run("accordion", 2, [0.9, 0.9, 0.9, 0.9], 0.25))
    return studies


def lstm_loopback() -> list[dict[str, Any]]:
    """lstm-text on loopback: dense ends at 5.0 (bar 5.15); cf100 never gets within 3%."""
    dense = [made_run(None, s, [9.0, 5.0]) for s in SEEDS]
    cf10 = [made_run("cf10", s, [9.0, 5.1, 5.1, 5.0], 0.2) for s in SEEDS]
    cf100 = [made_run("cf100", s, [6.0, 5.5, 5.3, 5.2], 0.05) for s in SEEDS]
    default = [made_run("default", s, [9.0, 6.0, 5.1, 5.1], 0.1) for s in SEEDS]
    return [
        study("dense", "lstm-text", None, dense),
        study("ladder", "lstm-text", None, cf10 + cf100),
        study("searches", "lstm-text", None, default),
    ]


def stored_scoreboard(studies: list[dict[str, Any]], setups: str) -> dict[str, Any]:
    base = CompareConfig(steps=2 * EVERY)
    searches = (parse_variant("default=topk:exponential"),)
    header = settings(Inputs(base, parse_setups(setups), (10.0, 100.0), searches, SEEDS, 30))
    return {"scoreboard": header, "studies": studies}
