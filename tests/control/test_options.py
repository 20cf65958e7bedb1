"""The controller's config (gravac.control.options): its checks, and the search options'
defaults as the searches read them."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gravac import policies
from gravac.control.factory import make_controller
from gravac.control.options import DEFAULT_HORIZON, ControllerConfig
from gravac.control.searches.shadow import ShadowController
from gravac.control.searches.trial import TrialController


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"search": "guess"}, "search must be one of"),
        ({"progress": "norm"}, "progress must be one of"),
        ({"search": "paper", "progress": "cosine"}, "search='paper' ranks by"),
        ({"horizon": 0}, "horizon must be None or an integer >= 1, got 0"),
        ({"horizon": 2.0}, "horizon must be None or an integer >= 1, got 2.0"),
        ({"horizon": True}, "horizon must be None or an integer >= 1"),
        ({"search": "trial", "horizon": 2}, "search='trial' judges a window"),
        ({"search": "paper", "horizon": 3}, "search='paper' judges a window"),
        ({"noise": 1}, "noise must be True, False or None, got 1"),
        ({"search": "trial", "noise": True}, "search='trial' does not measure"),
        ({"epsilon": math.nan}, "epsilon must be a number in"),
    ],
)
def test_bad_search_options_are_named(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**options)


def search(kind: type, **options: Any) -> Any:
    made = make_controller(
        policies.create("exponential"), ControllerConfig(**options), 2, replayable=True
    )
    assert type(made) is kind
    return made


def test_the_searches_predict_progress_by_the_gain_itself_unless_told() -> None:
    assert ControllerConfig().progress_measure == "energy"
    assert ControllerConfig(progress="cosine").progress_measure == "cosine"
    trial = search(TrialController, search="trial", progress="cosine")
    assert trial.worth(0.64) == pytest.approx(0.8)
    assert search(ShadowController).worth(0.64) == pytest.approx(0.64)


def test_the_horizon_is_the_searchs_default_unless_told() -> None:
    assert search(ShadowController).horizon == DEFAULT_HORIZON
    assert search(ShadowController, horizon=3).plan().horizon == 3
    assert search(TrialController, search="trial", horizon=1).plan().horizon == 1


def test_the_searches_prefer_fewer_bytes_within_omega_unless_told() -> None:
    assert ControllerConfig().preference == "bytes"
    assert ControllerConfig(prefer="gain").preference == "gain"
    with pytest.raises(ValueError, match=r"prefer must be one of \('bytes', 'gain'\) or None"):
        ControllerConfig(prefer="speed")
    with pytest.raises(ValueError, match="prefer applies to the searches by trial and shadow"):
        ControllerConfig(search="paper", prefer="gain")


def test_noise_is_on_for_the_search_by_shadow_unless_told() -> None:
    assert search(ShadowController).plan().signal
    assert not search(ShadowController, noise=False).plan().signal
    assert not search(TrialController, search="trial").plan().signal


@pytest.mark.parametrize("policy", ["fixed", "accordion"])
def test_shadow_only_options_with_a_ladder_no_search_runs_are_refused(policy: str) -> None:
    ladder = policies.create(policy, **({"cf": 10.0} if policy == "fixed" else {}))
    with pytest.raises(ValueError, match=f"horizon=2 needs the search by shadow.*{policy!r}"):
        make_controller(ladder, ControllerConfig(horizon=2), 2, replayable=True)
