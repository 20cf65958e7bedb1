"""The ladders (scaling policies): pure step-size sequences, and their registry."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from gravac import policies


def windows_to_reach(policy: policies.ScalingPolicy, target: float) -> int:
    s, j = policy.first(), 0
    while s < target:
        j += 1
        s = policy.next(s, j)
    return j


def test_geometric_multiplies_by_ratio() -> None:
    p = policies.create("geometric", ratio=3.0)
    assert p.first() == 3.0
    assert p.next(3.0, 1) == 9.0
    assert p.next(9.0, 2) == 27.0


def test_exponential_growth_grows() -> None:
    p = policies.create("exponential")
    s = [p.first()]
    for j in range(1, 5):
        s.append(p.next(s[-1], j))
    assert s == [2.0, 4.0, 16.0, 128.0, 2048.0]
    ratios = [b / a for a, b in itertools.pairwise(s)]
    assert all(r2 > r1 for r1, r2 in itertools.pairwise(ratios))


def test_exponential_reaches_theta_max_in_fewer_windows() -> None:
    target = 1000 / 10
    assert windows_to_reach(policies.create("exponential"), target) < windows_to_reach(
        policies.create("geometric"), target
    )


def test_fixed_pins_the_cf() -> None:
    p = policies.create("fixed", cf=50)
    assert p.static_cf == 50.0


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("nope", {}, "unknown policy 'nope'"),
        ("geometric", {"ratio": 1.0}, "ratio"),
        ("exponential", {"ratio": math.nan}, "ratio"),
        ("geometric", {"rate": 2.0}, "no option 'rate'"),
        ("fixed", {}, "needs option 'cf'"),
        ("fixed", {"cf": 0.5}, "cf"),
        ("exponential", {"search": "trial"}, "no option 'search'"),  # the config's now
    ],
)
def test_bad_policies_raise(name: str, options: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        policies.create(name, **options)


def test_the_registry_builds_each_policy_it_names_and_lists_them_when_refusing() -> None:
    names = policies.names()
    assert names and names == sorted(set(names))
    for name in names:
        policy = policies.create(name, **({"cf": 10.0} if name == "fixed" else {}))
        assert type(policy) is policies.get(name) and policy.name == name
    with pytest.raises(
        ValueError, match=re.escape(f"unknown policy 'nope'; choose one of {names}")
    ):
        policies.create("nope")
