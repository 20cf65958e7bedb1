"""``gravac bench shadow``: what the search by shadow adds to a step.

The search by shadow (:mod:`gravac.control.searches.shadow`) replays error feedback on a sample of
the gradient for every CF of its ladder at every step (:mod:`gravac.control.replay`): a sample of
``x - e`` at launch, then one selection per CF at close (while the step's collectives travel),
applied at commit. This times both for the exponential and
the geometric policies' default ladders (CFs 10 to 1000) on a gradient of the benchmark's layout
(:func:`gravac_lab.bench.common.model_layout`, one bucket), against ``dst.copy_(src)`` of the whole
gradient in the same loop, and reports the memory the shadows keep against the gradient's (with the
sums of the earlier windows that the default horizon keeps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gravac import compressors, policies
from gravac.compressors import Replayable
from gravac.control.factory import make_controller
from gravac.control.options import DEFAULT_HORIZON, ControllerConfig
from gravac.control.replay import ShadowSums
from gravac.control.searches.shadow import ShadowController
from gravac_lab.bench.common import (
    DEFAULT_REPEATS,
    DEFAULT_SEED,
    ELEMENT_BYTES,
    describe_size,
    environment,
    format_table,
    interleaved_medians,
    json_row,
    model_layout,
    synthetic_gradients,
)

__all__ = ["ShadowResult", "bench_shadow", "format_shadow_table"]

#: the policies whose default ladders are timed
POLICIES = ("exponential", "geometric")
#: the compressor replayed (the sparsifiers all replay as an exact top-k)
COMPRESSOR = "topk"


@dataclass(frozen=True)
class ShadowResult:
    """One row of ``gravac bench shadow`` (times in seconds, memory in bytes).

    ``of_copy = (sample_s + replay_s) / copy_s``: a step's shadow work in copies of the gradient.
    """

    policy: str
    size: int
    repeats: int
    cfs: tuple[float, ...]
    sample_s: float
    replay_s: float
    copy_s: float
    of_copy: float
    state_bytes: int
    gradient_bytes: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""
        return json_row(self)


def ladder(policy: str) -> tuple[float, ...]:
    """The default ladder of ``policy`` under the search by shadow (CFs 10 to 1000)."""
    config = ControllerConfig(search="shadow")
    c = make_controller(policies.create(policy), config, 2, snap=lambda cf: cf, replayable=True)
    assert isinstance(c, ShadowController)
    return c.ladder


def bench_shadow(
    *,
    size: int,
    repeats: int = DEFAULT_REPEATS,
    seed: int = DEFAULT_SEED,
    device: torch.device | str = "cpu",
) -> list[ShadowResult]:
    """A row per policy of :data:`POLICIES` (see the module docstring)."""
    device = torch.device(device)
    x, e = synthetic_gradients(size, 2, seed=seed, device=device)
    numels = [s.numel() for s in model_layout(size)]
    layers = tuple(range(len(numels)))
    replayable = compressors.create(COMPRESSOR)
    assert isinstance(replayable, Replayable)  # a sparsifier
    select = replayable.shadow_kept
    dst = torch.empty_like(x)
    rows = []
    for policy in POLICIES:
        cfs = ladder(policy)
        sums = ShadowSums()
        sums.fit(sum(numels))  # the stride a run samples this layout at (a budget above 64M)
        sample = sums.gradient(x, e, numels)

        def gather(sums: ShadowSums = sums) -> Any:
            return lambda: sums.gradient(x, e, numels)

        def replay(
            sums: ShadowSums = sums, cfs: tuple[float, ...] = cfs, sample: torch.Tensor = sample
        ) -> Any:
            return lambda: sums.apply(
                sums.replay(cfs, layers, numels, sample, select, accumulate=True)
            )

        sample_s, replay_s, copy_s = interleaved_medians(
            [gather, replay, lambda: lambda: dst.copy_(x)],
            repeats=repeats,
            device=device,
        )
        # a window closes, kept for the default horizon, and the next one sends: the memory
        # of a run's steady state, which holds the earlier window's sums beside this one's
        sums.clear(DEFAULT_HORIZON - 1)
        replay()()
        rows.append(
            ShadowResult(
                policy,
                size,
                repeats,
                cfs,
                sample_s,
                replay_s,
                copy_s,
                (sample_s + replay_s) / copy_s,
                sums.nbytes(),
                size * ELEMENT_BYTES,
            )
        )
    return rows


def format_shadow_table(results: Sequence[ShadowResult], *, seed: int, device: torch.device) -> str:
    """The human-readable report of ``gravac bench shadow``: a header, then a table."""
    r0 = results[0]
    header = [
        f"gravac bench shadow: {describe_size(r0.size)}, median of {r0.repeats} repeats after"
        f" one warm-up, seed {seed}, {environment(device)}",
        "  sample: the replayed sample of x - e (at launch); replay: one selection per CF of"
        " the ladder, applied (at close and commit); copy: dst.copy_(src) of the gradient",
        "  of copy = (sample + replay) / copy; state: the shadows' residuals and sums (this"
        " window's and the horizon's earlier ones), and the sample's indices",
    ]
    headers = ["policy", "CFs", "sample ms", "replay ms", "copy ms", "of copy", "state/grad"]
    rows = [
        [
            r.policy,
            str(len(r.cfs)),
            f"{r.sample_s * 1e3:.3g}",
            f"{r.replay_s * 1e3:.3g}",
            f"{r.copy_s * 1e3:.3g}",
            f"{r.of_copy:.2f}",
            f"{r.state_bytes / r.gradient_bytes:.3f}",
        ]
        for r in results
    ]
    return "\n".join([*header, "", format_table(headers, rows)])
