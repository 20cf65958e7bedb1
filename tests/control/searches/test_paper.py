"""GraVAC's Algorithm 1 (gravac.control.searches.paper) on scripted gain and throughput
sequences; a static CF (gravac.control.searches.static); the controller's config and tables."""

from __future__ import annotations

import math

import pytest

from gravac import policies
from gravac.control.factory import make_controller
from gravac.control.options import ControllerConfig
from gravac.control.protocol import Controller
from gravac.control.records import Observation, Phase, Sample, Skipped
from gravac.control.searches.paper import PaperController
from gravac.control.searches.static import StaticController
from gravac.control.tables import Smoothed, ewma


def make(
    *,
    policy: str = "geometric",
    warmup: int = 2,
    window: int = 3,
    epsilon: float = 0.5,
    omega: float = 0.05,
    theta_max: float = 1000.0,
    **policy_options: float,
) -> PaperController:
    cfg = ControllerConfig(
        theta_min=10.0,
        theta_max=theta_max,
        epsilon=epsilon,
        omega=omega,
        window=window,
        warmup_steps=warmup,
        ewma_alpha=1.0,  # no smoothing: each step's gain is the gain
        search="paper",
    )
    c = make_controller(policies.create(policy, **policy_options), cfg, world_size=2)
    assert isinstance(c, PaperController)
    return c


def run_step(
    c: Controller, gain_min: float, gain_c: float, tsys: dict[float, float] | None = None
) -> tuple[float, str, float | None]:
    """One step: the plan (from earlier steps), then the step's scripted gains and a scripted
    throughput at the CF it sent, observed."""
    plan = c.plan()
    d = plan.send
    throughput = None if tsys is None else Sample(d.cf, tsys.get(d.cf, 100.0))
    candidate = gain_c if plan.candidate is not None else None
    c.observe(Observation(plan, gain=gain_min, gain_candidate=candidate, throughput=throughput))
    return d.cf, d.which, plan.candidate


def test_warmup_sends_theta_min_whatever_the_gain_then_searches() -> None:
    c = make(warmup=2)
    assert c.phase == Phase.WARMUP
    for _ in range(2):
        cf, which, cand = run_step(c, gain_min=0.0, gain_c=0.0)
        assert (cf, which, cand) == (10.0, "min", None)
    assert c.phase == Phase.SEARCH
    assert c.plan().candidate == 20.0  # theta_min * r for the geometric policy, r = 2


def test_send_candidate_min_or_dense_by_epsilon_of_the_previous_step() -> None:
    """The decision at step t reads gains agreed through step t - 1 (docs/design.md section 8)."""
    c = make(warmup=0, window=100)
    # no gain yet: theta_min is sent, the candidate only measured
    assert run_step(c, 0.9, 0.8)[:2] == (10.0, "min")
    assert run_step(c, 0.9, 0.4)[:2] == (20.0, "candidate")  # from (0.9, 0.8)
    assert run_step(c, 0.3, 0.1)[:2] == (10.0, "min")  # from (0.9, 0.4)
    assert run_step(c, 0.3, 0.1)[:2] == (1.0, "dense")  # from (0.3, 0.1)


def test_theta_min_escalates_when_gains_are_within_omega() -> None:
    c = make(warmup=0, window=2, omega=0.05)
    for _ in range(2):
        run_step(c, 0.80, 0.79, tsys={10.0: 100.0, 20.0: 150.0})
    assert c.theta_min == 20.0
    assert c.plan().candidate == 80.0  # theta_min 20 * s 4 after the geometric step


def test_theta_min_stays_when_gains_differ() -> None:
    c = make(warmup=0, window=2, omega=0.05)
    for _ in range(2):
        run_step(c, 0.9, 0.6, tsys={10.0: 100.0, 20.0: 300.0})
    assert c.theta_min == 10.0
    assert c.plan().candidate == 40.0


def test_saturated_throughput_settles_on_the_lower_cf_and_reopens() -> None:
    c = make(warmup=0, window=2, omega=0.05)
    # 20 is sent; 10 gets a throughput too via one min step: tput equal within omega
    c.smoothed.fold_tsys(10.0, 100.0)
    for _ in range(2):
        run_step(c, 0.9, 0.6, tsys={20.0: 100.0 * 0.9 / 0.6})
    assert c.phase == Phase.SETTLED
    assert c.theta_ideal == 10.0  # min(cf1, cf2)
    # settled: the candidate is theta_ideal (here = theta_min, so none is evaluated)
    assert c.plan().candidate is None
    # the gain of theta_ideal drops below epsilon for a window: search reopens
    for _ in range(2):
        run_step(c, 0.2, 0.0)
    assert c.phase == Phase.SEARCH


def test_unsaturated_throughput_scales_up_by_policy() -> None:
    c = make(warmup=0, window=1, policy="exponential", theta_max=1e6)
    seen = []
    for step in range(4):
        # a one-step window measures its new candidate (no gain before it) and sends theta_min
        cf, which, cand = run_step(c, 0.95, 0.6, tsys={})
        assert which == "min"
        c.smoothed.fold_tsys(cf, 100.0 * 10 ** (step + 1))
        seen.append(cand)
    # exponential with r = 2: s = 2, 2*2, 4*4, 16*8
    assert seen == [20.0, 40.0, 160.0, 1280.0]
    assert c.theta_min == 10.0


def test_exhausted_search_at_theta_max_settles_on_best_tput() -> None:
    c = make(warmup=0, window=2, theta_max=40.0, omega=0.0)
    tputs = {10.0: 100.0, 20.0: 300.0, 40.0: 200.0}
    for _ in range(6):
        if c.phase == Phase.SETTLED:
            break
        run_step(c, 1.0, 0.9, tsys=tputs)
        c.smoothed.fold_tsys(10.0, tputs[10.0])
    assert c.phase == Phase.SETTLED
    assert c.theta_ideal == 20.0


def test_fixed_policy_sends_its_cf_always() -> None:
    c = make_controller(policies.create("fixed", cf=100.0), ControllerConfig(window=3), 2)
    assert isinstance(c, StaticController) and c.phase == "fixed"
    plans = []
    for _ in range(10):
        plans.append(c.plan())
        assert run_step(c, 0.0, 0.0) == (100.0, "min", None)
    # it measures no gain unless told, and carries the window gain once a window (a step
    # that carries it starts the next window)
    assert not any(p.measure for p in plans)
    assert [i for i, p in enumerate(plans) if p.window_terms] == [3, 6, 9]


def test_a_static_warmup_sends_its_cfs_in_order_then_the_static_cf() -> None:
    warmup = [[1, 1000], [2, 1], [1, 40.0]]
    c = make_controller(policies.create("fixed", cf=100.0, warmup=warmup), ControllerConfig(), 2)
    sent = []
    for step in range(7):
        if step == 2:  # a step skipped on every rank is not a step of the schedule
            assert c.observe(Skipped(c.plan())).phase == "fixed"
        sent.append(run_step(c, 0.0, 0.0)[0])
    assert sent == [1000.0, 1.0, 1.0, 40.0, 100.0, 100.0, 100.0]


def test_a_static_warmup_resumes_where_it_stood() -> None:
    def make_static() -> Controller:
        policy = policies.create("fixed", cf=100.0, warmup=[[3, 10], [2, 20]])
        return make_controller(policy, ControllerConfig(), 2)

    a, b = make_static(), make_static()
    first = [run_step(a, 0.0, 0.0)[0] for _ in range(4)]
    b.load_state_dict(a.state_dict())
    assert first == [10.0, 10.0, 10.0, 20.0]
    assert [run_step(b, 0.0, 0.0)[0] for _ in range(2)] == [20.0, 100.0]


@pytest.mark.parametrize(
    ("warmup", "match"),
    [
        ("10", "must be a list of \\[steps, cf\\] pairs, got '10'"),
        ([[1, 10, 2]], "warmup\\[0\\] must be a pair \\[steps, cf\\], got \\[1, 10, 2\\]"),
        ([[0, 10]], "warmup\\[0\\] steps must be an integer >= 1, got 0"),
        ([[1, 10], [2.5, 10]], "warmup\\[1\\] steps must be an integer >= 1, got 2.5"),
        ([[1, 0.5]], "warmup\\[0\\] cf must be a finite number >= 1, got 0.5"),
    ],
)
def test_a_bad_static_warmup_is_refused_by_name(warmup: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        policies.create("fixed", cf=100.0, warmup=warmup)


def test_a_static_cf_that_measures_smooths_its_gains() -> None:
    c = make_controller(policies.create("fixed", cf=100.0, measure=True), ControllerConfig(), 2)
    plan = c.plan()
    report = c.observe(Observation(plan, gain=0.8, throughput=Sample(100.0, 50.0)))
    assert plan.measure and report.gain == 0.8 and report.system_throughput == 50.0
    assert c.observe(Skipped(c.plan())).phase == "fixed"


def test_state_dict_round_trip_continues_identically() -> None:
    script = [(0.9, 0.85), (0.9, 0.5), (0.3, 0.2), (0.95, 0.94)] * 5
    a = make(warmup=1, window=2)
    for g in script[:7]:
        run_step(a, *g, tsys={10.0: 50.0, 20.0: 80.0, 1.0: 20.0})
    b = make(warmup=1, window=2)
    b.load_state_dict(a.state_dict())
    for g in script[7:]:
        assert run_step(a, *g, tsys={10.0: 50.0}) == run_step(b, *g, tsys={10.0: 50.0})
    assert a.state_dict() == b.state_dict()


def test_ewma() -> None:
    assert ewma(None, 3.0, 0.1) == 3.0
    assert ewma(1.0, 3.0, 0.5) == 2.0


def test_default_alpha_is_workers_over_100() -> None:
    assert ControllerConfig().alpha(8) == pytest.approx(0.08)
    assert ControllerConfig().alpha(500) == 1.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("theta_min", 0.5),
        ("theta_max", 5.0),
        ("epsilon", 1.5),
        ("omega", -0.1),
        ("window", 0),
        ("warmup_steps", -1),
        ("ewma_alpha", 0.0),
    ],
)
def test_invalid_config_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ControllerConfig(**{field: value})  # type: ignore[arg-type]


def test_candidate_gain_is_required_when_a_candidate_is_planned() -> None:
    c = make(warmup=0)
    with pytest.raises(ValueError, match="candidate"):
        c.observe(Observation(c.plan(), gain=0.9))


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_throughput_sample_must_be_finite_and_positive(value: float) -> None:
    with pytest.raises(ValueError, match="samples_per_second"):
        Smoothed(0.5).fold_tsys(10.0, value)


def test_the_report_is_what_the_step_saw_before_the_window_rules() -> None:
    """The step that ends the warm-up is logged in the warm-up, with the gains it folded."""
    c = make(warmup=1)
    report = c.observe(Observation(c.plan(), gain=0.7, throughput=Sample(10.0, 40.0)))
    assert report.phase == "warmup" and c.phase == "search"
    assert report.gain == 0.7 and report.system_throughput == 40.0
    assert report.compression_throughput == pytest.approx(28.0)


def test_a_skipped_step_changes_nothing() -> None:
    c = make(warmup=2)
    before = c.state_dict()
    assert c.observe(Skipped(c.plan())).phase == "warmup"
    assert c.state_dict() == before


def test_resnap_moves_every_cf_held_onto_the_new_deliverable_ones() -> None:
    """After the compressor is bound to a layout, theta_min, the tables and the plans use only
    the CFs it now delivers (here: multiples of 3)."""
    step: list[float] = []  # empty: every CF is deliverable

    def snap(cf: float) -> float:
        return cf if not step else max(step[0], step[0] * round(cf / step[0]))

    c = make()
    c = make_controller(c.policy, c.config, world_size=2, snap=snap)
    assert isinstance(c, PaperController)
    for _ in range(4):
        run_step(c, 0.9, 0.9, {10.0: 50.0})
    assert set(c.smoothed.gain) == set(c.smoothed.tsys) == {10.0, 20.0}
    step.append(3.0)
    c.resnap()
    assert c.theta_min == 9.0 and set(c.smoothed.gain) == set(c.smoothed.tsys) == {9.0, 21.0}
    plan = c.plan()
    assert plan.cf == 9.0 and plan.candidate is not None and plan.candidate % 3 == 0
