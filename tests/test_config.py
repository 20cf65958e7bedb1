"""GravacConfig: one configuration for the optimizer, the DDP hook and the lab, checked when
made, with keywords as sugar and ``search`` as a first-class option."""

from __future__ import annotations

import dataclasses
import math
import pickle
import warnings
from typing import Any

import pytest
import torch

from gravac import GravacConfig, GravacOptimizer, compressors, policies
from gravac.config import LOCAL_FIELDS, build_engine, make_config
from gravac.control.options import ControllerConfig
from gravac.control.searches.paper import PaperController
from gravac.control.searches.shadow import ShadowController
from gravac.control.searches.trial import TrialController
from gravac.ddp import GravacHookState
from tests.helpers import counter_clock, tiny_model


def test_the_defaults_are_the_controllers() -> None:
    assert GravacConfig().controller_config() == ControllerConfig()


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"compressor": 3}, "compressor must be one of"),
        ({"policy": object()}, "policy must be one of"),
        ({"compressor_options": [1]}, "compressor_options must be a dict"),
        ({"policy_options": "cf=10"}, "policy_options must be a dict"),
        ({"search": "guess"}, "search must be one of ('trial', 'paper', 'shadow', 'auto')"),
        ({"progress": "speed"}, "progress must be one of ('energy', 'cosine') or None"),
        ({"horizon": 0}, "horizon must be None or an integer >= 1, got 0"),
        ({"search": "trial", "horizon": 2}, "horizon applies to the search by shadow"),
        ({"search": "paper", "noise": True}, "noise applies to the search by shadow"),
        ({"search": "paper", "progress": "cosine"}, "progress applies to the searches by trial"),
        ({"error_feedback": 1}, "error_feedback must be True or False, got 1"),
        ({"monitor": 3}, "monitor must be None, a gravac Monitor"),
        ({"nonfinite": "ignore"}, "nonfinite must be one of ('skip', 'raise'), got 'ignore'"),
        ({"batch_size": 0}, "batch_size must be None or an integer >= 1, got 0"),
        ({"step_timeout": 0}, "step_timeout must be None or a finite number of seconds >= 0.001"),
        ({"step_timeout": -5.0}, "seconds >= 0.001, got -5.0"),
        ({"step_timeout": math.inf}, "seconds >= 0.001, got inf"),
        ({"step_timeout": True}, "seconds >= 0.001, got True"),
        ({"step_timeout": "30"}, "seconds >= 0.001, got '30'"),
        ({"theta_min": 0.5}, "theta_min must be a finite number >= 1, got 0.5"),
        ({"theta_max": 5.0}, "theta_max must be >= theta_min (10.0), got 5.0"),
        ({"epsilon": 2}, "epsilon must be a number in [0, 1], got 2"),
        ({"window": 0}, "window must be an integer >= 1, got 0"),
        ({"policy": "fixed", "search": "trial", "policy_options": {"search": "paper"}}, "twice"),
        ({"horizon": 3, "policy_options": {"horizon": 2}}, "horizon is given twice"),
    ],
)
def test_a_bad_option_is_named_when_the_config_is_made(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as exc:
        GravacConfig(**options)
    assert says in str(exc.value)


def test_both_front_ends_hand_the_step_timeout_to_their_collectives() -> None:
    """``step_timeout`` reaches the communicator (the default: the process group's own)."""
    assert build_engine().comm.timeout is None
    assert build_engine(step_timeout=2.5).comm.timeout == 2.5
    sgd = torch.optim.SGD(tiny_model().parameters(), lr=0.1)
    assert GravacOptimizer(sgd, step_timeout=4).comm.timeout == 4
    assert GravacHookState(None, GravacConfig(step_timeout=30.0)).engine.comm.timeout == 30.0


def test_options_go_with_names_not_instances() -> None:
    with pytest.raises(ValueError, match="compressor_options go with a compressor name"):
        GravacConfig(compressor=compressors.create("topk"), compressor_options={"exact": True})
    with pytest.raises(ValueError, match="policy_options go with a policy name"):
        GravacConfig(policy=policies.create("exponential"), policy_options={"ratio": 4})


def test_a_ladder_instance_takes_any_search() -> None:
    """The ladder is pure: the search that runs it is the config's."""
    engine = build_engine(policy=policies.create("geometric", ratio=4), search="trial")
    assert type(engine.controller) is TrialController


@pytest.mark.parametrize(
    ("search", "kind"),
    [("trial", TrialController), ("shadow", ShadowController), ("paper", PaperController)],
)
def test_search_chooses_the_controller(search: str, kind: type) -> None:
    engine = build_engine(search=search)
    assert type(engine.controller) is kind
    assert engine.controller_config.search == search


@pytest.mark.parametrize(
    ("options", "field", "value"),
    [
        ({"search": "trial"}, "search", "trial"),
        ({"search": "shadow", "horizon": 3}, "horizon", 3),
        ({"progress": "cosine"}, "progress", "cosine"),
        ({"noise": False}, "noise", False),
    ],
)
def test_search_options_in_policy_options_still_work_with_a_deprecation_warning(
    options: dict[str, Any], field: str, value: object
) -> None:
    with pytest.warns(DeprecationWarning, match=rf"pass .*{field}=\.\.\. to gravac"):
        engine = build_engine(policy_options=options)
    assert getattr(engine.controller_config, field) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert getattr(build_engine(**options).controller_config, field) == value


def test_keywords_replace_the_configs_fields() -> None:
    config = GravacConfig(compressor="randomk", window=7, search="trial")
    model = tiny_model()
    opt = GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config, window=9)
    assert opt.engine.compressor.name == "randomk"
    assert opt.engine.controller_config.window == 9
    assert type(opt.engine.controller) is TrialController
    assert make_config(config) is config
    assert make_config(config, window=9) == dataclasses.replace(config, window=9)
    with pytest.raises(TypeError, match="windows"):
        make_config(config, windows=9)
    with pytest.raises(ValueError, match=r"config must be a GravacConfig or None, got \{\}"):
        GravacOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), {})  # type: ignore[arg-type]


def test_the_hook_state_keeps_its_config_and_pickles_it_without_local_fields() -> None:
    clock = counter_clock()
    state = GravacHookState(None, GravacConfig(search="trial", clock=clock), window=5)
    assert state.config.window == 5 and state.config.clock is clock
    assert state.engine.controller_config.window == 5
    options = state.__getstate__()["options"]
    assert not set(options) & set(LOCAL_FIELDS)
    again = pickle.loads(pickle.dumps(state))
    assert again.config == state.config  # monitor and clock are not compared
    assert again.config.clock is not clock
    assert type(again.engine.controller) is TrialController
