"""Accordion (Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
Identification", MLSys 2021; docs/design.md section 9.6): two CFs, chosen per layer by regime.

Every ``interval`` steps each layer's norm of its gradient accumulated over the interval is
compared with the previous interval's: a relative change ``|prev - new| / prev >= eta`` marks a
critical regime, sent at ``low_cf`` for the next interval; otherwise ``high_cf``. The first
interval, the one after it (nothing to compare with yet) and every learning-rate decay send
``low_cf``. With a compressor that sends at ranks (PowerSGD) the two settings are ranks,
``low_rank`` and ``high_rank`` (4 and 1 by default, as the GraVAC paper ran Accordion), the same
rank for every layer whatever its shape; one CF would be a different rank per shape. The CF
defaults are the paper's Top-k settings: 99% of the values kept in a critical regime
(CF 1/0.99), 10% otherwise (CF 10), eta 0.5; a CF of 2 or less is a sparsifier's break-even,
where values and indices would outweigh the tensor, so a critical layer is sent dense
(:data:`gravac.compressors.sparse.BREAK_EVEN_CF`). For PowerSGD, a CF ``c`` sends an
``m x n`` matrix at rank ``floor(mn / (c (m + n)))`` (at least 1): the paper's ranks 4 and 1
are CFs near ``mn / (4 (m + n))`` and anything at or above ``mn / (m + n)``, which is why
the ranks are the settings there.

The policy is configuration; :class:`gravac.control.searches.accordion.AccordionController` runs it,
through the same engine as every other policy.
"""

from __future__ import annotations

import math
from typing import ClassVar

from gravac.checks import check_cf
from gravac.control.policies.base import ScalingPolicy, register

__all__ = [
    "DEFAULT_ETA",
    "DEFAULT_HIGH_CF",
    "DEFAULT_HIGH_RANK",
    "DEFAULT_INTERVAL",
    "DEFAULT_LOW_CF",
    "DEFAULT_LOW_RANK",
    "AccordionPolicy",
]

#: CF of a critical regime: Top-k keeping 99% of the values (Accordion's Top-k "high" setting)
DEFAULT_LOW_CF = 1 / 0.99
#: CF otherwise: Top-k keeping 10% (Accordion's Top-k "low" setting on CIFAR-10)
DEFAULT_HIGH_CF = 10.0
#: rank of a critical regime with a compressor that sends at ranks (Accordion's PowerSGD "low"
#: compression, as the GraVAC paper ran it)
DEFAULT_LOW_RANK = 4
#: rank otherwise
DEFAULT_HIGH_RANK = 1
#: steps between regime decisions: one GraVAC window (the paper decides every 10 epochs,
#: 10-30 decisions a run; 25 steps give 12 in a 300-step comparison)
DEFAULT_INTERVAL = 25
#: relative change of a layer's accumulated-gradient norm that marks a critical regime (the
#: value hard-coded in Accordion's code)
DEFAULT_ETA = 0.5


@register
class AccordionPolicy(ScalingPolicy):
    """Send each layer at ``low_cf`` in a critical regime, else at ``high_cf``.

    Args:
        low_cf: the CF of critical regimes (less compression), >= 1.
        high_cf: the CF otherwise, >= ``low_cf``.
        interval: steps between decisions, >= 1.
        eta: the relative norm change that marks a critical regime, > 0.
        low_rank: the rank of critical regimes with a compressor that sends at ranks
            (PowerSGD; ``None``: :data:`DEFAULT_LOW_RANK`), an integer >= 1.
        high_rank: the rank otherwise (``None``: :data:`DEFAULT_HIGH_RANK`), <= ``low_rank``.
    """

    name: ClassVar[str] = "accordion"

    def __init__(
        self,
        *,
        low_cf: float = DEFAULT_LOW_CF,
        high_cf: float = DEFAULT_HIGH_CF,
        interval: int = DEFAULT_INTERVAL,
        eta: float = DEFAULT_ETA,
        low_rank: int | None = None,
        high_rank: int | None = None,
    ) -> None:
        self.low_cf = check_cf(low_cf, name="accordion policy option low_cf")
        self.high_cf = check_cf(high_cf, name="accordion policy option high_cf")
        if self.high_cf < self.low_cf:
            raise ValueError(
                f"accordion policy option high_cf must be >= low_cf ({self.low_cf:g}), "
                f"got {self.high_cf:g}"
            )
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"accordion policy option interval must be an integer >= 1, got {interval!r}"
            )
        self.interval = interval
        finite = isinstance(eta, int | float) and not isinstance(eta, bool) and math.isfinite(eta)
        if not finite or eta <= 0:
            raise ValueError(
                f"accordion policy option eta must be a finite number > 0, got {eta!r}"
            )
        self.eta = float(eta)
        #: whether the ranks were given (a compressor that takes none refuses them)
        self.ranks_given = low_rank is not None or high_rank is not None
        self.low_rank = _rank("low_rank", DEFAULT_LOW_RANK if low_rank is None else low_rank)
        self.high_rank = _rank("high_rank", DEFAULT_HIGH_RANK if high_rank is None else high_rank)
        if self.high_rank > self.low_rank:
            raise ValueError(
                f"accordion policy option high_rank must be <= low_rank ({self.low_rank}): "
                f"a lower rank is more compression, got {self.high_rank}"
            )

    def first(self) -> float:
        return 1.0  # no candidate is scaled: the controller never asks

    def next(self, s: float, window: int) -> float:
        return s


def _rank(name: str, value: object) -> int:
    """``value``, an integer >= 1, or a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"accordion policy option {name} must be an integer >= 1, got {value!r}")
    return value
