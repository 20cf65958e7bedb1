"""``gravac compare``'s pure parts: option parsing, registries, the summary of a raw record."""

from __future__ import annotations

import re

import pytest
import torch

from gravac.cli import build_parser
from gravac_lab.compare import config, modes, netns, report, workloads
from gravac_lab.compare.config import ADAM_LR, CompareConfig
from gravac_lab.compare.modes import check_config
from tests.workers import Workers

#: parameters of the VGG-style workload: conv 1->64, conv 64->128 (3x3, biases), 8192->640,
#: 640->10 (with biases)
VGG_PARAMETERS = (64 * 9 + 64) + (128 * 64 * 9 + 128) + (8192 * 640 + 640) + (640 * 10 + 10)


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8), ("125mbps", 10**9)],
)
def test_parse_rate_reads_tc_units(text: str, bits: int) -> None:
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1gb", "", "10kbit", "-1gbit"])
def test_parse_rate_rejects_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--bandwidth"):
        netns.parse_rate(text)


@pytest.mark.parametrize(("text", "seconds"), [("1ms", 1e-3), ("500us", 5e-4), ("0.5s", 0.5)])
def test_parse_delay(text: str, seconds: float) -> None:
    assert netns.parse_delay(text) == pytest.approx(seconds, rel=1e-12)


def test_parse_delay_rejects_naming_the_option() -> None:
    with pytest.raises(ValueError, match="--delay"):
        netns.parse_delay("1 hour")


def test_vgg_workload_has_the_specified_shape() -> None:
    model = workloads.get("vgg-digits").model()
    assert workloads.parameter_count(model) == VGG_PARAMETERS == 5_324_426
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)


def test_registries_name_their_entries() -> None:
    # each mode is found by its name, and `gravac compare --help` offers every one
    compare = build_parser()._subparsers._group_actions[0].choices["compare"]  # type: ignore[union-attr,index]
    offered = re.sub(r"-\s+", "-", compare.format_help())  # argparse wraps at hyphens
    assert modes.names() and str(modes.names()) in offered
    assert all(modes.get(name).name == name for name in modes.names())
    assert {"vgg-digits", "tiny-digits"} <= set(workloads.names())
    with pytest.raises(ValueError, match="--workload"):
        workloads.get("mnist")
    with pytest.raises(ValueError, match="--modes"):
        modes.get("horovod")


def test_config_round_trips_through_json() -> None:
    cfg = CompareConfig(
        modes=("ddp", "gravac"),
        policy="fixed",
        policy_options={"cf": 100},
        bandwidth="1gbit",
        lr_milestones=(150, 250),
    )
    assert CompareConfig.from_json(cfg.to_json()) == cfg
    assert cfg.rate_bits == 10**9
    assert cfg.target_value == workloads.DEFAULT_TARGET


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"modes": ()}, "--modes"),
        ({"modes": ("ddp", "ddp")}, "--modes"),
        ({"workers": 1}, "--workers"),
        ({"steps": 5, "timing_warmup": 5}, "--steps"),
        ({"steps": 10, "modes": ("ddp-powersgd",)}, "--powersgd-start"),
        ({"powersgd_start": 1}, "--powersgd-start"),
        ({"policy": "fixed"}, "--policy-options"),
        ({"policy_options": {"nope": 1}}, "--policy-options"),
        ({"theta_min": 100.0, "theta_max": 10.0}, "--theta-max"),
        ({"delay": "1ms"}, "--delay"),
        ({"momentum": 1.0}, "--momentum"),
        ({"lr_milestones": (5, 5)}, "--lr-milestones must increase"),
        ({"lr_milestones": (0,)}, "--lr-milestones must be an integer >= 1"),
        ({"lr_gamma": 1.5}, r"--lr-gamma must be in \(0, 1\]"),
        ({"optimizer": "lamb"}, r"--optimizer must be one of \['sgd', 'adam'\], got 'lamb'"),
    ],
)
def test_config_rejects_naming_the_option(options: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        check_config(CompareConfig(**options))  # type: ignore[arg-type]


def test_every_mode_trains_with_the_optimizer_named() -> None:
    """SGD at the workload's rate with momentum, or Adam at 1e-3 (``--lr`` replaces either)."""
    model = torch.nn.Linear(3, 2)
    sgd = modes._optimizer(model, CompareConfig(workload="vgg-digits"))
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.param_groups[0]["lr"] == workloads.get("vgg-digits").lr
    assert sgd.param_groups[0]["momentum"] == 0.9
    adam = modes._optimizer(model, CompareConfig(optimizer="adam"))
    assert isinstance(adam, torch.optim.Adam) and adam.param_groups[0]["lr"] == ADAM_LR
    assert (
        modes._optimizer(model, CompareConfig(optimizer="adam", lr=0.01)).param_groups[0]["lr"]
        == 0.01
    )


def _raw(comm: float | None, cf: list[float | None] | None = None) -> dict[str, object]:
    """A scripted rank-0 record of 4 steps, evaluated at steps 2 and 4 (``cf``: the CF sent
    each step, none by default, as DDP)."""
    return {
        "step_seconds": [9.0, 1.0, 2.0, 3.0],
        "forward_backward_seconds": [9.0, 0.5, 0.75, 1.0],
        "compute_seconds": [0.25, 0.5, 0.5],
        "wire_bytes": [400, 100, 100, 120],
        "compress_seconds": [None, 0.1, 0.2, 0.3],
        "comm_seconds": [comm] * 4,
        "cf_sent": [None] * 4 if cf is None else cf,
        "cf_achieved": [None] * 4 if cf is None else [c and c * 0.5 for c in cf],
        "evaluations": [[2, 10.0, 0.5], [4, 15.0, 0.97]],
        "parameters": 100,
        "options": {},
    }


def test_summarise_takes_medians_after_the_warmup_and_the_time_to_target() -> None:
    cfg = CompareConfig(modes=("ddp", "gravac"), steps=4, timing_warmup=1)
    ddp = report.summarise(modes.get("ddp"), cfg, _raw(None))
    assert (ddp.step_seconds, ddp.forward_backward_seconds, ddp.compute_seconds) == (
        2.0,
        0.75,
        0.5,
    )
    assert ddp.comm_source == "exposed"
    assert ddp.comm_seconds == 0.25  # forward and backward beyond the bare model's
    assert ddp.compress_seconds is None
    assert ddp.other_seconds == 2.0 - 0.5 - 0.25  # the step beyond compute and comm
    assert ddp.wire_bytes == 720
    assert ddp.wire_bytes_per_step == 100
    assert ddp.dense_wire_bytes_per_step == 400
    assert (ddp.time_to_target_seconds, ddp.steps_to_target, ddp.final_metric) == (
        15.0,
        4,
        0.97,
    )
    gravac = report.summarise(modes.get("gravac"), cfg, _raw(0.125))
    assert (gravac.compress_seconds, gravac.comm_seconds) == (0.2, 0.125)
    assert gravac.other_seconds == 2.0 - 0.5 - 0.2 - 0.125


def test_summarise_keeps_the_run_s_variant_seed_and_per_step_series() -> None:
    cfg = CompareConfig(modes=("gravac",), steps=4, timing_warmup=1, seed=7)
    cf = [1.0, 10.0, None, 20.0]  # dense, then a skipped step
    summary = report.summarise(
        modes.get("gravac"), cfg, _raw(0.125, cf), variant="exp", ranks_agree=True
    )
    assert (summary.variant, summary.seed, summary.ranks_agree) == ("exp", 7, True)
    assert summary.wire_bytes_by_step == [400, 100, 100, 120]
    assert summary.cf_sent_by_step == cf
    assert summary.cf_achieved_by_step == [0.5, 5.0, None, 10.0]
    ddp = report.summarise(modes.get("ddp"), cfg, _raw(None))
    assert (ddp.variant, ddp.ranks_agree, ddp.cf_sent_by_step) == (None, None, [None] * 4)


def test_decisions_agree_compares_every_rank_s_cf_with_rank_0_s() -> None:
    cf = [10.0, 10.0, 20.0, None]
    assert report.decisions_agree([_raw(0.1, cf), _raw(0.2, list(cf))]) is True
    assert report.decisions_agree([_raw(0.1, cf), _raw(0.1, [10.0, 20.0, 20.0, None])]) is False
    assert report.decisions_agree([_raw(None), _raw(None)]) is None  # DDP decides none


def test_summarise_reports_a_target_never_reached_as_none() -> None:
    cfg = CompareConfig(modes=("ddp",), steps=4, timing_warmup=1, target=0.99)
    summary = report.summarise(modes.get("ddp"), cfg, _raw(None))
    assert summary.time_to_target_seconds is None
    assert summary.steps_to_target is None


def test_powersgd_timing_starts_at_compression() -> None:
    cfg = CompareConfig(modes=("ddp-powersgd",), steps=20, timing_warmup=3, powersgd_start=10)
    assert modes.get("ddp-powersgd").timed_from(cfg) == 10
    assert modes.get("ddp").timed_from(cfg) == 3


def test_quick_defaults_are_consistent() -> None:
    cfg = CompareConfig(
        modes=config.QUICK_MODES,
        workload=workloads.QUICK_WORKLOAD,
        steps=config.QUICK_STEPS,
        eval_every=config.QUICK_EVAL_EVERY,
    )
    assert cfg.steps > cfg.timing_warmup


def _bucket_sizes(rank: int, world_size: int, bucket_bytes: int | None) -> list[object]:
    """The bucket size each gravac mode trains with, for ``bucket_bytes`` among the engine
    options (``None``: not given), on the VGG-style CNN with the fp16 compressor."""
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    cfg = CompareConfig(
        modes=("gravac", "gravac-ddp"),
        compressor="fp16",
        policy="fixed",
        policy_options={"cf": 2},
        engine_options=options,
    )
    out: list[object] = []
    for name in cfg.modes:
        session = modes.get(name).open(workloads.get("vgg-digits").model(), cfg)
        out.append(session.options()["bucket_bytes"])
        if name == "gravac":
            out.append(len(session.optimizer._fresh_layout().compressed))
        else:
            out.append(session.module.bucket_bytes_cap)
        session.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bucket_bytes", "expected"),
    [
        # the cast's 2 MiB: the last layer (the first bucket), the 21 MB layer in 10 pieces,
        # both convolutions in one; DDP keeps its 25 MiB
        (None, [2 * 2**20, 12, None, 25 * 2**20]),
        (2**24, [2**24, 4, 2**24, 2**24]),
    ],
    ids=["default", "given"],
)
def test_bucket_bytes_reaches_the_optimizer_and_the_hook_mode_s_ddp(
    bucket_bytes: int | None, expected: list[object], gloo_pools: Workers
) -> None:
    assert gloo_pools.run(_bucket_sizes, 1, bucket_bytes, timeout=120)[0] == expected


def test_engine_options_reject_a_negative_bucket_size_naming_it() -> None:
    with pytest.raises(ValueError, match=r"bucket_bytes must be an integer >= 1 or None, got -1"):
        modes.check_engine_options({"bucket_bytes": -1}, {}, option="--engine-options")
