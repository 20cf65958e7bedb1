"""The scaling-policy interface and registry (GraVAC section IV-B; docs/design.md section 9).

A policy decides, from explicit state that the controller owns, how the candidate's step size
``s`` grows at the end of each search window (the candidate CF is ``min(theta_min * s,
theta_max)``). Policies are small, immutable objects: they checkpoint trivially and test without
fixtures. A policy with a :attr:`ScalingPolicy.static_cf` pins the CF instead (the baseline).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, TypeVar

from gravac.control.window import PROGRESS_MEASURES
from gravac.registry import Registry

__all__ = [
    "DEFAULT_HORIZON",
    "SEARCHES",
    "ScalingPolicy",
    "check_horizon",
    "check_noise",
    "check_progress",
    "check_search",
    "create",
    "get",
    "names",
    "register",
]

#: how an adaptive policy's candidates are judged: each sent for a window and judged by the
#: gain error feedback delivered over it (:mod:`gravac.control.trial`), GraVAC's Algorithm 1 as the
#: paper states it, by each step's gain (:class:`gravac.control.controller.Controller`), all at once
#: by error feedback replayed on a sample, without sending them
#: (:mod:`gravac.control.shadow_search`), or ``"auto"``: by shadow where the compressor's sends can
#: be replayed (a sparsifier under plain error feedback), else by trial
SEARCHES = ("trial", "paper", "shadow", "auto")


def check_search(search: object, policy: str) -> str:
    """A search must be one of :data:`SEARCHES`."""
    if search not in SEARCHES:
        raise ValueError(f"{policy} policy option search must be one of {SEARCHES}, got {search!r}")
    return str(search)


def check_progress(progress: object, search: str, policy: str) -> str:
    """How the searches by trial and shadow predict a CF's progress per step from its window
    gain (:data:`gravac.control.window.PROGRESS_MEASURES`; ``None``: ``"energy"``). Algorithm 1 (the
    ``"paper"`` search) ranks by its per-step gain as an energy ratio and takes no other.

    Raises:
        ValueError: ``progress`` is not a measure, or is given with the ``"paper"`` search.
    """
    if progress is not None and progress not in PROGRESS_MEASURES:
        raise ValueError(
            f"{policy} policy option progress must be one of {PROGRESS_MEASURES} or None, "
            f"got {progress!r}"
        )
    if search == "paper" and progress is not None:
        raise ValueError(
            f"{policy} policy option progress applies to the searches by trial and shadow; "
            f"search='paper' ranks by Algorithm 1's per-step gain, got progress={progress!r}"
        )
    return "energy" if progress is None else str(progress)


#: windows the search by shadow's window gains span unless told: a high CF's residual is
#: delivered steps later, so a gain over two windows (50 steps, decisions still every 25) judges
#: it over more of what error feedback delivers; 2 sent as many bytes as 1 or fewer and reached
#: the target as soon, and 3 or 4 did no better (``docs/studies/2026-12-01-window-horizon.md``)
DEFAULT_HORIZON = 2


def check_horizon(horizon: object, search: str, policy: str) -> int | None:
    """How many windows the search by shadow's window gains span (``None``: the search's
    default, :data:`DEFAULT_HORIZON` for the search by shadow, 1 for the others): at each
    window's end, the gains judged cover that window and the ``horizon - 1`` before it, so a
    gain's horizon may exceed how often the search decides. Only the search by shadow takes
    more than one (the search by trial judges each candidate by the one window it was sent).

    Raises:
        ValueError: ``horizon`` is not an integer >= 1, or is more than 1 with a search that
            is neither ``"shadow"`` nor ``"auto"``.
    """
    if horizon is None:
        return None
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"{policy} policy option horizon must be an integer >= 1, got {horizon!r}")
    if horizon > 1:
        _check_shadow_only(policy, "horizon", horizon, search, "judges a window at a time")
    return horizon


def check_noise(noise: object, search: str, policy: str) -> bool | None:
    """Whether the search by shadow counts what error feedback held back against a CF by its
    share of signal (:mod:`gravac.control.noise`; ``None``: the search's default, on for the search
    by shadow). Only the search by shadow measures the share.

    Raises:
        ValueError: ``noise`` is not a bool or ``None``, or is ``True`` with a search that is
            neither ``"shadow"`` nor ``"auto"``.
    """
    if noise is None:
        return None
    if not isinstance(noise, bool):
        raise ValueError(f"{policy} policy option noise must be True, False or None, got {noise!r}")
    if noise:
        _check_shadow_only(policy, "noise", noise, search, "does not measure the signal share")
    return noise


def _check_shadow_only(policy: str, option: str, value: object, search: str, why: str) -> None:
    """Refuse ``option=value``, which only the search by shadow takes, with a ``search`` that
    cannot run it (``why``: what that search does instead); ``"auto"`` runs it where the
    compressor can be replayed, and the engine refuses it elsewhere."""
    if search not in ("shadow", "auto"):
        raise ValueError(
            f"{policy} policy option {option} applies to the search by shadow; search={search!r} "
            f"{why}, got {option}={value!r}"
        )


class ScalingPolicy(ABC):
    """How the candidate CF scales between search windows."""

    name: ClassVar[str]
    #: a CF sent at every step, with no search; ``None`` for adaptive policies
    static_cf: float | None = None
    #: the search that runs the policy (:data:`SEARCHES`)
    search: str = "auto"
    #: how its search predicts a CF's progress per step from the CF's gain (:func:`check_progress`)
    progress: str = "energy"
    #: windows its search by shadow's window gains span (:func:`check_horizon`; ``None``: the
    #: search's default)
    horizon: int | None = None
    #: whether its search by shadow counts held-back energy by its signal share
    #: (:func:`check_noise`; ``None``: the search's default)
    noise: bool | None = None
    #: a static CF's steps still measure their gain (for studies; adaptive policies always do)
    measure: bool = False

    @abstractmethod
    def first(self) -> float:
        """The step size ``s`` of the first search window (> 1)."""

    @abstractmethod
    def next(self, s: float, window: int) -> float:
        """The step size after the ``window``-th search window (1-based) used step size ``s``."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


_REGISTRY: Registry[ScalingPolicy] = Registry("policy")
P = TypeVar("P", bound=type[ScalingPolicy])


def register(cls: P) -> P:
    """Class decorator: make ``cls`` available as ``create(cls.name)``."""
    _REGISTRY.register(cls)
    return cls


def names() -> list[str]:
    """Registered policy names, sorted."""
    return _REGISTRY.names()


def get(name: str) -> type[ScalingPolicy]:
    """The class registered as ``name``."""
    return _REGISTRY.get(name)


def create(name: str, **options: Any) -> ScalingPolicy:
    """Build policy ``name`` with keyword ``options``; unknown names or options raise."""
    return _REGISTRY.create(name, **options)
