"""Every rank's hook state in a framework's checkpoint (``gravac.integrations._ranks``)."""

from __future__ import annotations

import pytest
import torch

from gravac.integrations._ranks import mean_residuals, on_cpu


def test_the_mean_residuals_owe_the_mean_aggregate_what_the_saved_ones_did() -> None:
    """3 saved ranks resumed on 2: ``(1/2) sum e' == (1/3) sum e`` at every position, a piece
    one rank lacks counted as its zeros, each piece in its own dtype; the rest is rank 0's."""
    gen = torch.Generator().manual_seed(0)
    states = [
        {
            "steps": 7,
            "rank_only": r,
            "residuals": {
                0: torch.randn(5, generator=gen),
                **({1: torch.randn(3, generator=gen).half()} if r != 1 else {}),
            },
        }
        for r in range(3)
    ]
    merged = mean_residuals(states, 2)
    assert merged["world_size"] == 2 and merged["steps"] == 7 and merged["rank_only"] == 0
    for k, dtype in ((0, torch.float32), (1, torch.float16)):
        e = merged["residuals"][k]
        assert e.dtype == dtype
        owed = sum(s["residuals"][k].double() for s in states if k in s["residuals"]) / 3
        # two ranks holding e each owe (1/2)(e + e) = e: what the three owed, to e's rounding
        assert torch.equal(e, owed.to(dtype))


def test_no_state_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one rank's state"):
        mean_residuals([], 2)


def test_on_cpu_keeps_the_structure_and_the_values() -> None:
    state = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "x"}
    moved = on_cpu(state)
    assert moved["b"] == "x" and isinstance(moved["a"][1], tuple) and moved["a"][1][1] == 3
    assert torch.equal(moved["a"][0], torch.ones(2)) and moved["a"][0].device.type == "cpu"
