"""The search by shadow (gravac.control.searches.shadow) on scripted shadow gains and links, and
through the engine: logged gains, resume, and the compressors it refuses."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from gravac.config import build_engine
from gravac.control.link import between_seconds, link_seconds
from gravac.control.records import Observation, Phase, Sample, Skipped
from gravac.control.searches.sent import MIN_WARMUP_STEPS
from gravac.control.searches.shadow import MIN_SIGNAL_SHARE, TOP_WARMUP_STEPS, ShadowController
from gravac.control.searches.trial import TrialController
from tests.control.searches.test_trial import (
    COMPUTE_BOUND,
    MODERATE,
    OMEGA,
    SLOW,
    WINDOW,
    Link,
    scripted,
    windows,
)
from tests.helpers import (
    MOVING_OMEGA,
    Records,
    resume_windowed,
    train_square,
    windowed_optimizer,
)

EXPONENTIAL_LADDER = (10.0, 20.0, 40.0, 160.0, 1000.0)


@dataclass(frozen=True)
class EngineTimed:
    """A link timed as the engine times it: a step's time runs from the end of the step before
    to its own end, so it holds the compute ``a``, its compression (``w`` over its CF) and its
    wait for communication (``b`` over its CF); it is agreed with the next step's scalars,
    counted at its own CF, and neither a run's first step nor a resume's is timed (no step
    ended before it), though its communication is."""

    link: Link
    w: float  # compression seconds per sample at CF 1: its cost grows with the elements kept

    def alone(self, cf: float) -> float:
        """Seconds per sample of a step at ``cf``."""
        return self.link.a + (self.link.b + self.w) / cf


#: the VGG-style digits CNN on loopback, as a scripted link: compression, which grows with the
#: elements kept, costs more than the communication (33 ms a step at CF 10, 12 at CF 100)
LOOPBACK = EngineTimed(COMPUTE_BOUND, 0.3)
#: a slow link, timed as the engine times it
SLOW_TIMED = EngineTimed(SLOW, 0.01)


def timed(
    link: Link | EngineTimed, sent: list[float], cf: float
) -> list[tuple[float, float | None, float]]:
    """What the engine records at a step that sends ``cf`` after the CFs ``sent`` (since the
    run's or the resume's start): the CF it counts the times at, the samples/s (``None``: not
    timed) and the communication per sample."""
    if isinstance(link, EngineTimed):
        if not sent:
            return []
        tsys = 1.0 / link.alone(sent[-1]) if len(sent) > 1 else None
        return [(sent[-1], tsys, link.link.comm(sent[-1]))]
    return [(cf, link.tsys(cf), link.comm(cf))]


def make(
    policy: str = "exponential",
    warmup: int = 2,
    progress: str | None = None,
    horizon: int | None = None,
    noise: bool | None = None,
    prefer: str | None = None,
    **config: float,
) -> ShadowController:
    """A search by shadow (``progress``, ``horizon``, ``noise`` and ``prefer``: the config's
    options)."""
    options = {"progress": progress, "horizon": horizon, "noise": noise, "prefer": prefer}
    options.update(config)
    c = scripted(policy, "shadow", warmup, **options)
    assert isinstance(c, ShadowController)
    return c


def run(
    c: ShadowController,
    steps: int,
    gain: Callable[[int, float], float],
    link: Link | EngineTimed,
    real: Callable[[int, float], float] | None = None,
    share: Callable[[int], float | None] | None = None,
    slowed: Mapping[int, float] | None = None,
) -> list[float]:
    """``steps`` steps, each planned and then observed as the engine observes it: ``gain(step,
    cf)`` is the shadow window gain of ``cf`` at a step that closes a window, ``real`` the real
    window gain of the CF sent (``gain``'s if not given), ``share(step)`` the window's signal
    share (none if not given, as with one rank); ``link`` times the steps (:func:`timed`), the
    interval timed at a step of ``slowed`` that many times longer (a step slowed by something
    else; ``math.inf``: not timed, as at a resume's first step). The CF sent at each step."""
    real = real or gain
    slowed = slowed or {}
    sent: list[float] = []
    for step in range(steps):
        plan = c.plan()
        assert plan.shadows == c.ladder
        cf = plan.send.cf
        throughput = comm = None
        for at, tsys, seconds in timed(link, sent, cf):
            factor = slowed.get(step, 1.0)
            if tsys is not None and math.isfinite(factor):
                throughput = Sample(at, tsys / factor)
            comm = Sample(at, seconds)
        window = plan.window_terms
        c.observe(
            Observation(
                plan,
                gain_window=real(step, c.windows.current) if window else None,
                shadow_gains={s: gain(step, s) for s in plan.shadows} if window else {},
                signal_share=share(step) if window and plan.signal and share is not None else None,
                throughput=throughput,
                comm=comm,
            )
        )
        sent.append(cf)
    return sent


def falling(step: int, cf: float) -> float:
    """Gains that fall with the CF: 0.98 at 10, 0.9 at 20, 0.8 at 40, 0.6 at 160, 0.3 at 1000."""
    return {10.0: 0.98, 20.0: 0.9, 40.0: 0.8, 160.0: 0.6}.get(cf, 0.3)


def test_the_ladder_is_theta_min_and_the_policys_candidates() -> None:
    assert make().ladder == EXPONENTIAL_LADDER
    assert make("geometric").ladder == (10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1000.0)


def test_on_a_slow_link_it_goes_from_theta_min_straight_to_the_best_cf() -> None:
    """No window is spent at 20 or 40: CF 160's throughput times gain is the largest. The
    warm-up ended early, and of its steps and its bridge only the second sent theta_min."""
    c = make(warmup=10)
    sent = run(c, 12, falling, SLOW)
    assert sent[: MIN_WARMUP_STEPS + 1] == [1000.0, 10.0, 1000.0, 1000.0]
    assert windows(sent) == [1000.0, 10.0, 1000.0, 160.0]
    tput = c.shadow_tput()
    assert max(tput, key=tput.__getitem__) == 160.0 and 1000.0 not in tput  # 0.3 < epsilon


def test_on_a_fast_link_the_warm_up_sends_theta_min_but_at_its_top_steps() -> None:
    c = make(warmup=10)
    sent = run(c, 30, falling, COMPUTE_BOUND)
    assert [i for i, cf in enumerate(sent) if cf != 10.0] == list(TOP_WARMUP_STEPS)
    assert c.windows.theta_ideal == 10.0


class FirstStepSlow(Link):
    """A link whose first step took 100x its time (the run's one-off costs)."""

    def __init__(self, link: Link) -> None:
        super().__init__(link.a, link.b)
        object.__setattr__(self, "calls", 0)

    def tsys(self, cf: float) -> float:
        object.__setattr__(self, "calls", self.calls + 1)
        return super().tsys(cf) / (100.0 if self.calls == 1 else 1.0)


@pytest.mark.parametrize("link", [SLOW, COMPUTE_BOUND])
def test_the_link_model_reads_theta_mins_steps_only(link: Link) -> None:
    """The warm-up's first step sends the top of the ladder, and its time, 100x too slow, is
    not kept: the link model's throughputs are the link's."""
    c = make(warmup=10)
    run(c, 11, falling, FirstStepSlow(link))
    assert c.windows_closed >= 1
    assert c.windows.smoothed.tsys[10.0] == pytest.approx(link.tsys(10.0))
    for cf in c.ladder:
        assert c.estimated_tsys(cf) == pytest.approx(link.tsys(cf))


def test_the_warm_ups_real_gain_corrects_no_shadow() -> None:
    """It sent theta_min and the top of the ladder: its real gain (0.2, as if all of it were
    sent at CF 1000) is theta_min's neither over its window nor over the next."""
    c = make(warmup=10)
    run(c, 11, falling, COMPUTE_BOUND, real=lambda step, cf: 0.2)
    assert c.excess == {} and c.last_sent is None and c.judged_gain(10.0) == 0.98
    run(c, WINDOW + 1, falling, COMPUTE_BOUND)
    assert 10.0 not in c.excess and (c.windows_closed, c.same_windows) == (2, 1)
    run(c, WINDOW + 1, falling, COMPUTE_BOUND)
    assert c.excess == {10.0: 0.0}


def test_when_compute_bound_it_stays_at_theta_min() -> None:
    c = make()
    assert set(run(c, 20, falling, COMPUTE_BOUND)) == {10.0}
    assert c.phase == Phase.SETTLED and c.windows.theta_ideal == 10.0


def test_of_cfs_within_omega_of_the_best_throughput_the_largest_is_chosen() -> None:
    c = make(omega=0.05)
    run(c, 3, lambda step, cf: 0.9, MODERATE)  # warm-up (2 steps) and its bridge
    tput = c.shadow_tput()
    top = max(tput.values())
    assert c.windows.theta_ideal == max(cf for cf, t in tput.items() if t >= 0.95 * top)
    assert c.windows.theta_ideal == 1000.0  # equal gains: the cheapest CF


def test_with_prefer_gain_of_cfs_within_omega_the_smallest_is_chosen() -> None:
    """CF 160 judged best (91.2 samples/s of progress), CF 40 within omega of it (87.1: its step
    slower, its gain higher), CF 10 not (66.6): the search sends CF 40, by default CF 160."""
    gains = {10.0: 0.999, 20.0: 0.995, 40.0: 0.98, 160.0: 0.94, 1000.0: 0.86}
    chosen = {}
    for prefer in ("gain", None):
        c = make(prefer=prefer)
        run(c, 3, lambda step, cf: gains[cf], MODERATE)  # warm-up (2 steps) and its bridge
        tput = c.shadow_tput()
        good = sorted(cf for cf, t in tput.items() if t >= (1 - OMEGA) * max(tput.values()))
        chosen[prefer] = c.windows.theta_ideal
    assert good == [40.0, 160.0]
    assert chosen == {"gain": 40.0, None: 160.0}


def test_with_progress_cosine_it_ranks_cfs_by_the_square_root_of_their_gains() -> None:
    """CF 160 keeps 0.7 of the energy at 97 samples/s, CF 40 0.8 at 89: as energies (the
    default) CF 40 is ahead by more than omega (71.1 against 67.9); as cosines CF 160 is
    (81.2 against 79.5)."""
    gains = {10.0: 0.98, 20.0: 0.9, 40.0: 0.8, 160.0: 0.7, 1000.0: 0.3}
    chosen = {}
    for progress in ("cosine", None):
        c = make(progress=progress)
        run(c, 3, lambda step, cf: gains[cf], MODERATE)  # warm-up (2 steps) and its bridge
        chosen[progress] = c.windows.theta_ideal
        assert c.shadow_tput()[160.0] == pytest.approx(
            MODERATE.tsys(160.0) * (math.sqrt(gains[160.0]) if progress else gains[160.0])
        )
    assert chosen == {"cosine": 160.0, None: 40.0}


def test_the_cf_sent_stays_while_within_omega_of_the_best() -> None:
    """Once CF 160 is sent, CF 1000 edging ahead by less than omega (3%) does not move it; by
    more (20%), it does."""
    first = {10.0: 0.98, 20.0: 0.8, 40.0: 0.75, 160.0: 0.72, 1000.0: 0.3}
    tput_160 = MODERATE.tsys(160.0) * first[160.0]

    def gain(step: int, cf: float) -> float:
        if cf != 1000.0 or step < 10:
            return first[cf]
        edge = 1.03 if step < 20 else 1.2
        return edge * tput_160 / MODERATE.tsys(1000.0)

    sent = run(make(), 30, gain, MODERATE)
    assert windows(sent) == [10.0, 160.0, 1000.0]
    assert sent.index(1000.0) > 20


def test_the_real_window_gain_of_the_cf_sent_corrects_its_shadow() -> None:
    """CF 160's shadow says 0.6, but sent it delivers 0.45: the search goes back down and does
    not return while its shadow stays where it was."""

    def real(step: int, cf: float) -> float:
        return 0.45 if cf == 160.0 else falling(step, cf)

    c = make()
    sent = run(c, 30, falling, SLOW, real)
    assert windows(sent) == [10.0, 160.0, 40.0]
    assert c.excess[160.0] == pytest.approx(0.15) and c.judged_gain(160.0) == pytest.approx(0.45)
    assert c.excess[40.0] == 0.0


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_a_real_gain_corrects_the_shadow_once_it_spans_the_cf_alone(horizon: int) -> None:
    """With gains over ``horizon`` windows, the real gain of a CF just chosen still spans the
    windows of the CF before it: CF 160's shadow is corrected (0.6 -> 0.45) only after it was
    sent for ``horizon`` windows, and the search then goes down to 40 as with one window."""

    def real(step: int, cf: float) -> float:
        return 0.45 if cf == 160.0 else falling(step, cf)

    c = make(horizon=horizon)
    sent = run(c, 40, falling, SLOW, real)
    assert windows(sent) == [10.0, 160.0, 40.0]
    assert sent.count(160.0) == (WINDOW + 1) * horizon  # a window and its closing step
    assert c.excess[160.0] == pytest.approx(0.15)
    assert (c.windows_closed, c.same_windows) == (10, 9 - horizon)
    b = make(horizon=horizon)
    b.load_state_dict(c.state_dict())
    assert (b.windows_closed, b.same_windows, b.last_sent) == (10, 9 - horizon, 40.0)


def test_held_back_energy_counts_by_the_largest_signal_share_so_far() -> None:
    """Shares 0.6, then 0.2 and a window that could not measure one: the search keeps 0.6, so
    CF 1000's 0.3 is judged 1 - 0.7 * 0.6 = 0.58; a later 0.8 raises it (0.44: under epsilon)."""
    shares = iter([0.6, 0.2, None, 0.8])
    c = make()
    run(c, 3 + 2 * (WINDOW + 1), falling, SLOW, share=lambda step: next(shares))
    assert c.signal_share == 0.6
    assert c.judged_gain(1000.0) == pytest.approx(0.58)
    run(c, WINDOW + 1, falling, SLOW, share=lambda step: next(shares))  # the next window's
    assert c.signal_share == 0.8 and c.judged_gain(1000.0) == pytest.approx(0.44)


@pytest.mark.parametrize("share", [0.0, 0.23, MIN_SIGNAL_SHARE])
def test_at_most_half_of_the_held_back_energy_counts_as_noise(share: float) -> None:
    """However low the largest share measured (0.23 on one seed of vgg-digits, whose CF 1000
    then never reached the bar), CF 1000's 0.3 is judged 1 - 0.7 * 0.5 = 0.65, not 0.84."""
    c = make()
    run(c, 3, falling, SLOW, share=lambda step: share)
    assert c.signal_share == share and c.judged_gain(1000.0) == pytest.approx(0.65)


@pytest.mark.parametrize(
    ("noise", "share", "chosen"), [(None, 0.4, 1000.0), (None, None, 160.0), (False, 0.4, 160.0)]
)
def test_a_noisy_start_sends_the_cf_whose_held_back_energy_is_mostly_noise(
    noise: bool | None, share: float | None, chosen: float
) -> None:
    """On the slow link CF 1000 is the fastest once its gain (0.3) keeps epsilon: with a signal
    share of 0.4, counted as 0.5 (MIN_SIGNAL_SHARE), it does (0.65) and is sent; with no share
    measured (one rank), or with the policy option ``noise`` off, CF 160 is (as the gains alone
    say)."""
    c = make(noise=noise)
    assert c.plan().signal is (noise is None)
    sent = run(c, 3, falling, SLOW, share=lambda step: share)
    assert c.windows.theta_ideal == chosen and sent == [10.0] * 3


def test_the_signal_share_survives_a_checkpoint() -> None:
    c = make()
    run(c, 3, falling, SLOW, share=lambda step: 0.25)
    b = make()
    b.load_state_dict(c.state_dict())
    assert b.signal_share == 0.25 and b.judged_gain(1000.0) == c.judged_gain(1000.0)
    state = {k: v for k, v in c.state_dict().items() if k != "signal_share"}
    b.load_state_dict(state)  # a checkpoint from before the share: none measured yet
    assert b.signal_share is None and b.judged_gain(1000.0) == pytest.approx(0.3)


def test_the_choice_follows_the_gains_every_window_up_and_down() -> None:
    """Gains that rise as training goes on move the CF up at the next window, without a probe;
    gains that fall move it down."""

    def changing(step: int, cf: float) -> float:
        if step < 10:
            return falling(step, cf)
        if step < 20:
            return {1000.0: 0.9}.get(cf, 0.95)
        return {10.0: 0.98}.get(cf, 0.2)

    sent = run(make(), 30, changing, SLOW)
    assert windows(sent) == [10.0, 160.0, 1000.0, 10.0]


def test_with_no_cf_keeping_epsilon_a_window_goes_dense_then_it_decides_again() -> None:
    def gain(step: int, cf: float) -> float:
        return 0.2 if step < 6 else falling(step, cf)

    sent = run(make(), 14, gain, SLOW)
    assert windows(sent) == [10.0, 1.0, 160.0]


def test_between_seconds_are_linear_in_the_bytes() -> None:
    assert between_seconds(10.0, 10.0, 0.5, 1000.0, 0.02) == pytest.approx(0.5)
    assert between_seconds(1000.0, 10.0, 0.5, 1000.0, 0.02) == pytest.approx(0.02)
    # a + k / cf through CFs 10 and 1000 gives it at every CF between
    for cf in (20.0, 40.0, 160.0):
        assert between_seconds(cf, 10.0, 0.01 + 3 / 10, 1000.0, 0.01 + 3 / 1000) == (
            pytest.approx(0.01 + 3 / cf)
        )


def test_a_cf_not_sent_is_timed_between_the_nearest_cfs_timed_or_by_the_link_model() -> None:
    """Between two CFs sent, linear in the bytes; above the largest, the link model from it;
    below the smallest, from the smallest; the warm-up's time of the top of the ladder counts as
    one timed above, until the top is sent."""
    c = make()
    c.windows.smoothed.tsys, c.windows.comm = {10.0: 2.0, 160.0: 10.0}, {10.0: 0.4, 160.0: 0.02}
    assert c.estimated_tsys(10.0) == 2.0 and c.estimated_tsys(160.0) == 10.0
    want = 1.0 / between_seconds(40.0, 10.0, 0.5, 160.0, 0.1)
    assert c.estimated_tsys(40.0) == pytest.approx(want) != 1.0 / link_seconds(40.0, 10.0, 0.5, 0.4)
    assert c.estimated_tsys(1000.0) == pytest.approx(1.0 / link_seconds(1000.0, 160.0, 0.1, 0.02))
    c.top_seconds = 0.05  # the top of the ladder, 1000
    assert c.estimated_tsys(320.0) == pytest.approx(
        1.0 / between_seconds(320.0, 160.0, 0.1, 1000.0, 0.05)
    )
    c.windows.smoothed.tsys[1000.0], c.windows.comm[1000.0] = 25.0, 0.0  # sent: its own time
    assert c.estimated_tsys(1000.0) == 25.0
    assert c.estimated_tsys(320.0) == pytest.approx(
        1.0 / between_seconds(320.0, 160.0, 0.1, 1000.0, 0.04)
    )
    c.windows.smoothed.tsys, c.windows.comm = {40.0: 4.0}, {40.0: 0.1}
    assert c.estimated_tsys(10.0) == pytest.approx(1.0 / link_seconds(10.0, 40.0, 0.25, 0.1))


@pytest.mark.parametrize(("link", "steps"), [(LOOPBACK, 11), (SLOW_TIMED, MIN_WARMUP_STEPS + 1)])
def test_the_warm_up_times_the_top_of_the_ladder_from_the_engines_intervals(
    link: EngineTimed, steps: int
) -> None:
    """The engine times each step whole at its own CF: the top's time is its steps', on a fast
    link (three of them) and on a slow one (the one before the bridge); between it and
    theta_min the CFs are timed as the link times them."""
    c = make(warmup=10)
    run(c, steps, falling, link)
    assert c.windows_closed == 1
    assert c.ladder[-1] == 1000.0 and c.top_seconds == pytest.approx(link.alone(1000.0))
    resumed = make(warmup=10)
    resumed.load_state_dict(c.state_dict())
    assert resumed.top_seconds == c.top_seconds
    if link is LOOPBACK:  # theta_min's steps timed alone (the slow link's by the link model)
        for cf in c.ladder:
            assert c.estimated_tsys(cf) == pytest.approx(1.0 / link.alone(cf))


def test_where_compression_grows_with_the_elements_kept_the_search_leaves_theta_min() -> None:
    """On loopback a step at CF 10 costs 4x one at CF 1000, mostly compression, which the link
    model would keep at every CF (it scales the communication alone): without the top's time
    (the one top step of a short warm-up timed lost, as at a resume) the search stays at
    theta_min; with it, CF 160's throughput times gain is the largest (0.6 / 0.0119 s against
    0.98 / 0.04 s)."""
    timed_top = make(warmup=10)
    run(timed_top, 11, falling, LOOPBACK)
    assert timed_top.windows.theta_ideal == 160.0
    untimed = make(warmup=3)
    run(untimed, 4, falling, LOOPBACK, slowed={3: math.inf})
    assert untimed.top_seconds is None and untimed.windows.theta_ideal == 10.0


@pytest.mark.parametrize(("warmup", "skipped"), [(3, (3,)), (10, (3, 5, 7))])
def test_without_a_top_step_timed_the_top_is_not_timed(
    warmup: int, skipped: tuple[int, ...]
) -> None:
    """The first top step is never timed; no time agreed (as at a resume) for every later one
    leaves the top untimed: the link model as before."""
    c = make(warmup=warmup)
    run(c, warmup + 1, falling, LOOPBACK, slowed=dict.fromkeys(skipped, math.inf))
    assert c.windows_closed == 1 and c.top_seconds is None


@pytest.mark.parametrize("slowed", [{2: math.inf}, {7: math.inf}, {6: 10.0}, {3: 10.0}, {9: 10.0}])
def test_one_step_untimed_or_slowed_leaves_the_tops_time_and_theta_mins(
    slowed: dict[int, float],
) -> None:
    """The top's time is the median of its three steps timed, theta_min's the median of its
    steps: one step not timed or timed 10x too long moves neither (one step timed vgg-digits'
    top at 49-81 ms against a real 55)."""
    c = make(warmup=10)
    run(c, 11, falling, LOOPBACK, slowed=slowed)
    assert c.top_seconds == pytest.approx(LOOPBACK.alone(1000.0))
    assert c.estimated_tsys(10.0) == pytest.approx(1.0 / LOOPBACK.alone(10.0))


def test_a_top_timed_slower_than_the_link_model_gives_it_is_held_to_that() -> None:
    """Two of the three top steps 10x too long would time the top above theta_min, and every CF
    between with it, for good: the top's time is held to the link model's from theta_min, as
    without the top's steps, so the search stays at theta_min as the link model had it."""
    c = make(warmup=10)
    run(c, 11, falling, LOOPBACK, slowed={3: 10.0, 5: 10.0})
    want = link_seconds(1000.0, 10.0, 1.0 / c.windows.smoothed.tsys[10.0], c.windows.comm[10.0])
    assert c.top_seconds == pytest.approx(want) and c.windows.theta_ideal == 10.0


def test_a_skipped_bridge_step_is_repeated_with_its_gains() -> None:
    c = make(warmup=2)
    run(c, 2, falling, SLOW)
    plan = c.plan()
    assert plan.window_terms and plan.shadows == c.ladder
    c.observe(Skipped(plan))  # the bridge step was skipped on every rank: nothing measured
    assert c.plan().window_terms and c.windows.current == 10.0 and c.shadow_gain == {}
    run(c, 1, falling, SLOW)  # the bridge again, its gains measured
    assert c.windows.current == 160.0 and c.shadow_gain == {cf: falling(0, cf) for cf in c.ladder}


@pytest.mark.parametrize("split", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("link", [SLOW, COMPUTE_BOUND, LOOPBACK, SLOW_TIMED])
def test_a_resume_within_the_warm_up_sends_the_same_cfs(
    split: int, link: Link | EngineTimed
) -> None:
    """Resumed after ``split`` steps of a warm-up that sends the top of the ladder at some
    steps (on the slow link the fourth is its bridge, the fifth the first after it)."""
    a = make(warmup=10)
    run(a, split, falling, link)
    b = make(warmup=10)
    b.load_state_dict(a.state_dict())
    assert run(a, 30, falling, link) == run(b, 30, falling, link)


def test_resume_gives_the_same_decisions() -> None:
    def gain(step: int, cf: float) -> float:
        return falling(step, cf) * (1.0 + 0.01 * (step % 7))

    a = make()
    run(a, 8, gain, MODERATE)
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.shadow_gain == a.shadow_gain
    assert run(a, 30, gain, MODERATE) == run(b, 30, gain, MODERATE)


@pytest.mark.parametrize(
    ("compressor", "options"),
    [("dgc", {}), ("randomk", {}), ("thc", {}), ("topk", {"error_feedback": False})],
)
def test_a_compressor_that_cannot_be_replayed_is_refused(
    compressor: str, options: dict[str, bool]
) -> None:
    with pytest.raises(ValueError, match="search='shadow' needs a compressor") as info:
        build_engine(compressor=compressor, search="shadow", **options)
    assert repr(compressor) in str(info.value)


@pytest.mark.parametrize(
    ("compressor", "options"), [("dgc", {}), ("topk", {"error_feedback": False})]
)
def test_a_horizon_without_the_search_by_shadow_is_refused(
    compressor: str, options: dict[str, bool]
) -> None:
    with pytest.raises(ValueError, match="horizon=2 needs the search by shadow") as info:
        build_engine(compressor=compressor, horizon=2, **options)
    assert repr(compressor) in str(info.value)


def test_noise_without_the_search_by_shadow_is_refused() -> None:
    with pytest.raises(ValueError, match="noise=True needs the search by shadow") as info:
        build_engine(compressor="dgc", noise=True)
    assert "'dgc'" in str(info.value)


@pytest.mark.parametrize(
    ("compressor", "options", "horizon"),
    [("topk", {}, 2), ("topk", {"horizon": 1}, 1), ("dgc", {}, 1)],
)
def test_the_search_by_shadow_judges_over_two_windows_by_default_and_the_others_over_one(
    compressor: str, options: dict[str, Any], horizon: int
) -> None:
    """The windows the engine's window gains span, as the controller plans them."""
    controller = build_engine(compressor=compressor, **options).controller
    assert controller.plan().horizon == horizon


@pytest.mark.parametrize(
    ("compressor", "options", "kind"),
    [
        ("topk", {}, ShadowController),
        ("redsync", {}, ShadowController),
        ("dgc", {}, TrialController),  # its memory keeps momentum besides the residual
        ("thc", {}, TrialController),
        ("topk", {"error_feedback": False}, TrialController),
    ],
)
def test_search_auto_replays_where_the_compressor_can_be_replayed_and_tries_elsewhere(
    compressor: str, options: dict[str, bool], kind: type
) -> None:
    engine = build_engine(compressor=compressor, search="auto", **options)
    assert type(engine.controller) is kind


@pytest.mark.parametrize("horizon", [1, 2])
def test_the_engine_logs_every_shadow_gain_once_a_window_and_resumes_them(horizon: int) -> None:
    """Logged and resumed bit for bit, with the sums of the window before kept over a
    checkpoint for a horizon of two windows."""
    search = {"search": "shadow", "horizon": horizon}
    full = Records()
    model, opt = windowed_optimizer(full, WINDOW, **search)
    train_square(model, opt, range(20))
    logged = [(r.step, r.gain_shadow) for r in full.items if r.gain_shadow]
    assert [s for s, _ in logged] == [2, 6, 10, 14, 18]
    for _, gains in logged:
        assert [cf for cf, _ in gains] == list(EXPONENTIAL_LADDER)
        assert all(0.0 <= g <= 1.0 for _, g in gains)
        assert gains[0][1] > gains[-1][1]  # CF 10 delivers more than CF 1000
    assert "gain_shadow/cf160" in full.items[2].scalars()

    part = Records()
    resume_windowed(part, WINDOW, 9, 20, **search)
    resumed = [(r.step, r.gain_shadow, r.cf_sent) for r in part.items[9:]]
    assert resumed == [(r.step, r.gain_shadow, r.cf_sent) for r in full.items[9:]]


def test_each_choice_is_logged_with_what_it_compared_and_follows_from_it() -> None:
    """At every window's close the record holds the judged gain and the estimated samples/s of
    every CF of the ladder; the next window sends a CF whose compression throughput by them is
    within omega of the largest, and the largest such where it changed. Resumed bit for bit."""
    search = {"search": "shadow", "omega": MOVING_OMEGA}
    full = Records()
    model, opt = windowed_optimizer(full, WINDOW, **search)
    train_square(model, opt, range(20))
    config = opt.engine.controller.config
    closes = [i for i, r in enumerate(full.items) if r.judged]
    assert [full.items[i].step for i in closes] == [2, 6, 10, 14, 18]
    for i in closes[1:]:
        table, before = full.items[i].judged, full.items[i - 1].cf_sent
        assert [cf for cf, _, _ in table] == list(EXPONENTIAL_LADDER)
        tput = {cf: t * g for cf, g, t in table if g >= config.epsilon}
        assert all(math.isfinite(v) for v in tput.values())
        best = max(tput.values())
        sent = full.items[i + 1].cf_sent
        assert tput[sent] >= (1 - config.omega) * best
        if sent != before:
            assert sent == max(cf for cf, v in tput.items() if v >= (1 - config.omega) * best)
    sent = {r.cf_sent for r in full.items[3:]}
    assert len(sent) > 1  # the search moved: the rule was tested on a change
    assert "gain_judged/cf160" in full.items[closes[1]].scalars()
    assert "tsys_estimated/cf10" in full.items[closes[1]].scalars()

    part = Records()
    resume_windowed(part, WINDOW, 9, 20, **search)
    assert [r.judged for r in part.items[9:]] == [r.judged for r in full.items[9:]]


def test_a_horizon_of_two_windows_changes_the_gains_from_the_second_window_on() -> None:
    """The warm-up has no window before it, so its gains are one window's either way; the
    next window's (the same CF sent, so the same steps) span both with a horizon of two."""
    logged = []
    for horizon in (1, 2):
        records = Records()
        model, opt = windowed_optimizer(records, WINDOW, search="shadow", horizon=horizon)
        train_square(model, opt, range(7))
        logged.append([dict(r.gain_shadow) for r in records.items if r.gain_shadow])
    one, two = logged
    assert len(one) == len(two) == 2
    assert one[0] == two[0]
    assert all(one[1][cf] != two[1][cf] for cf in EXPONENTIAL_LADDER)


def test_a_checkpoint_of_the_search_by_trial_resumes_under_the_default_search() -> None:
    """Saved when the search by trial was the default, resumed where ``"auto"`` runs the search
    by shadow: the trial's measurements carry over, the shadows start at the next window and
    their gains are judged from the window after (as after a resume of its own)."""
    model, opt = windowed_optimizer(Records(), WINDOW, search="trial")
    train_square(model, opt, range(8))
    state = opt.state_dict()
    resumed = Records()
    model_b, opt_b = windowed_optimizer(resumed, WINDOW)
    model_b.load_state_dict(model.state_dict())
    opt_b.load_state_dict(state)
    controller = opt_b.engine.controller
    assert isinstance(controller, ShadowController)
    trial = opt.engine.controller
    assert isinstance(trial, TrialController)
    assert (
        controller.windows.smoothed.tsys == trial.windows.smoothed.tsys
        and controller.shadow_gain == {}
    )
    train_square(model_b, opt_b, range(8, 20))
    assert controller.shadow_gain  # judged again from the shadows' windows
    assert [r.step for r in resumed.items if r.gain_shadow] == [10, 14, 18]
