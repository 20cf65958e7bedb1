"""A static CF: the baseline every adaptive policy is compared with.

The optimizer sends at ``cf`` on every step, with no search and no fallback. Under error feedback
the window gain (:mod:`gravac.control.window`) is logged once a window; with ``measure=True`` each
step's gain is too, so a static run shows what the adaptive policies would have seen.

``warmup`` sends other CFs first: ``[[steps, cf], ...]``, each CF for its number of steps, in
order, then ``cf`` for the rest of training. DGC's warm-up is one (Lin et al., ICLR 2018,
section 3.3: the sparsity rises over the first epochs), and so is a search's first steps
replayed before a static CF, to tell what those steps change from what the search chose
(``docs/studies/2026-12-07-warmup-trajectory.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from gravac.checks import check_cf, is_integer
from gravac.control.policies.base import ScalingPolicy, register

__all__ = ["FixedPolicy", "check_warmup"]

#: the option's name in errors
_WARMUP = "fixed policy option warmup"


def check_warmup(warmup: Sequence[Sequence[float]]) -> tuple[tuple[int, float], ...]:
    """Validate a warm-up schedule: pairs ``[steps, cf]``, ``steps`` an integer >= 1 and ``cf``
    a CF (:func:`gravac.checks.check_cf`); returns it as ``(steps, cf)`` tuples.

    Raises:
        ValueError: naming the option, the bad value and what is allowed.
    """
    if isinstance(warmup, str | bytes) or not isinstance(warmup, Sequence):
        raise ValueError(f"{_WARMUP} must be a list of [steps, cf] pairs, got {warmup!r}")
    out = []
    for i, pair in enumerate(warmup):
        if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"{_WARMUP}[{i}] must be a pair [steps, cf], got {pair!r}")
        steps, cf = pair
        if not is_integer(steps) or steps < 1:
            raise ValueError(f"{_WARMUP}[{i}] steps must be an integer >= 1, got {steps!r}")
        out.append((int(steps), check_cf(cf, name=f"{_WARMUP}[{i}] cf")))
    return tuple(out)


@register
class FixedPolicy(ScalingPolicy):
    """Always send at ``cf`` (1 = dense), after the ``warmup`` schedule's CFs if one is given
    (see the module docstring); ``measure``: compute each step's gain too (a cost the adaptive
    policies pay), to log what a search would see."""

    name: ClassVar[str] = "fixed"

    def __init__(
        self, *, cf: float, measure: bool = False, warmup: Sequence[Sequence[float]] = ()
    ) -> None:
        self.static_cf = check_cf(cf, name="fixed policy option cf")
        if not isinstance(measure, bool):
            raise ValueError(f"fixed policy option measure must be true or false, got {measure!r}")
        self.measure = measure
        self.static_warmup = check_warmup(warmup)

    def first(self) -> float:
        return 1.0

    def next(self, s: float, window: int) -> float:
        return s
