"""The smoothed tables every search keeps: gain and system throughput by CF.

GraVAC (Algorithm 1) keeps, per CF, an EWMA of the compression gain and of the system
throughput (global samples per second while sending at the CF), and ranks CFs by the
compression throughput ``tput[cf] = tsys[cf] * gain[cf]`` (``gain[1] = 1``). CFs are table keys
rounded to :data:`_CF_DIGITS` digits, so that one CF computed twice names one entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gravac.control.records import Observation, Plan, Report

__all__ = ["Smoothed", "cf_key", "ewma", "snapper"]

#: digits CF keys are rounded to, so that theta_min * s computed twice names one table entry
_CF_DIGITS = 9


def ewma(old: float | None, new: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first sample is taken as it is."""
    return new if old is None else (1.0 - alpha) * old + alpha * new


def cf_key(cf: float) -> float:
    """The table key of a CF (rounded, so that one CF computed twice names one entry)."""
    return round(cf, _CF_DIGITS)


class Smoothed:
    """EWMAs of the gain (``gain``) and the system throughput (``tsys``) by CF.

    Args:
        alpha: the EWMA factor (:meth:`gravac.control.options.ControllerConfig.alpha`).
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.gain: dict[float, float] = {}
        self.tsys: dict[float, float] = {}

    def fold_gain(self, cf: float, g: float) -> None:
        """Fold one agreed gain sample at ``cf``."""
        k = cf_key(cf)
        self.gain[k] = ewma(self.gain.get(k), g, self.alpha)

    def fold_tsys(self, cf: float, samples_per_second: float) -> None:
        """Fold an agreed system-throughput sample measured while sending at ``cf``."""
        if not math.isfinite(samples_per_second) or samples_per_second <= 0:
            raise ValueError(f"samples_per_second must be finite and > 0, got {samples_per_second}")
        k = cf_key(cf)
        self.tsys[k] = ewma(self.tsys.get(k), samples_per_second, self.alpha)

    def fold(self, seen: Observation) -> None:
        """Fold a step's throughput sample and, where its plan measures them, its gains."""
        if seen.throughput is not None:
            self.fold_tsys(seen.throughput.cf, seen.throughput.value)
        plan = seen.plan
        if not plan.measure:
            return
        self.fold_gain(plan.cf, seen.gain)
        if plan.candidate is not None:
            if seen.gain_candidate is None:
                raise ValueError(f"a gain for candidate CF {plan.candidate} is required")
            self.fold_gain(plan.candidate, seen.gain_candidate)

    def smoothed_gain(self, cf: float) -> float | None:
        """The EWMA gain of ``cf`` (1 for dense), ``None`` before its first sample."""
        return 1.0 if cf == 1.0 else self.gain.get(cf_key(cf))

    def tput(self) -> dict[float, float]:
        """Compression throughput ``tsys[cf] * gain[cf]`` of every CF with both known."""
        gains = {**self.gain, 1.0: 1.0}
        return {cf: t * gains[cf] for cf, t in self.tsys.items() if cf in gains}

    def report(self, phase: str, plan: Plan) -> Report:
        """What a step of ``plan`` is logged with, from the tables as they are."""
        cf = cf_key(plan.send.cf)
        candidate = plan.candidate
        return Report(
            phase=phase,
            gain=self.smoothed_gain(plan.cf),
            gain_candidate=None if candidate is None else self.smoothed_gain(candidate),
            system_throughput=self.tsys.get(cf),
            compression_throughput=self.tput().get(cf),
        )

    def resnap(self, snap: Callable[[float], float]) -> None:
        """Key every entry by ``snap(cf)`` (where two keys meet, the larger CF's is kept)."""
        self.gain = {snap(cf): v for cf, v in sorted(self.gain.items())}
        self.tsys = {snap(cf): v for cf, v in sorted(self.tsys.items())}

    def state_dict(self) -> dict[str, Any]:
        """The tables, as sorted lists of ``(cf, value)``."""
        return {"gain": sorted(self.gain.items()), "tsys": sorted(self.tsys.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.gain = {float(k): float(v) for k, v in state["gain"]}
        self.tsys = {float(k): float(v) for k, v in state["tsys"]}


def snapper(snap: Callable[[float], float] | None) -> Callable[[float], float]:
    """The table key of the deliverable CF nearest a requested one: ``cf_key(snap(cf))``
    (``snap``: the compressor's :meth:`gravac.compressors.Compressor.deliverable_cf`; ``None``:
    every CF is deliverable)."""
    if snap is None:
        return cf_key
    return lambda cf: cf_key(snap(cf))
