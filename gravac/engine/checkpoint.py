"""Checks of a saved engine state, run before anything is loaded (docs/design.md section 13).

A checkpoint that cannot resume training must say so when it is loaded, naming what is wrong,
rather than load and fail later: a missing key, a residual of another size or dtype than the
bucket it belongs to (every later step would raise), or a non-finite residual (every later
step would be skipped, the parameters frozen for ever).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gravac.control.protocol import Controller
from gravac.control.searches.paper import PaperController
from gravac.control.searches.static import PHASE as STATIC_PHASE
from gravac.control.searches.static import StaticController
from gravac.hierarchy import Topology

__all__ = [
    "REQUIRED_KEYS",
    "check_compatible",
    "check_controller_state",
    "check_keys",
    "check_tables",
    "check_times",
    "interval_norms",
]

#: the keys every saved engine state holds (``memory`` too where the engine saves residuals)
REQUIRED_KEYS = (
    "steps",
    "skipped_steps",
    "total_wire_bytes",
    "total_dense_wire_bytes",
    "last_cf",
    "compressor",
    "controller",
)
#: the controllers whose checkpoints load into each other: the search by shadow's state is the
#: search by trial's and its shadows
_WINDOW_SEARCHES = {"TrialController", "ShadowController"}
#: the kind checkpoints saved before the searches were split record for a static CF and for
#: Algorithm 1 alike; the saved phase tells them apart
_OLD_KIND = "Controller"


def check_keys(state: Mapping[str, Any], *, with_memory: bool) -> None:
    """``state`` holds :data:`REQUIRED_KEYS` (and ``memory``, ``with_memory``).

    Raises:
        ValueError: naming the keys missing.
    """
    required = (*REQUIRED_KEYS, "memory") if with_memory else REQUIRED_KEYS
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(
            f"the checkpoint's gravac state is missing {missing} (keys: {sorted(state)}): not "
            "a state saved by this gravac"
        )


def check_times(state: Mapping[str, Any]) -> None:
    """The step before the checkpoint's times (``last_seconds``, ``last_comm``), where saved,
    are seconds, or -1 for none: the resumed first step sends them to every rank's controller.

    Raises:
        ValueError: naming the key, its value and what is allowed.
    """
    for key in ("last_seconds", "last_comm"):
        value = state.get(key, -1.0)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
        if not ok or (value < 0 and value != -1):
            raise ValueError(
                f"the checkpoint's {key} is {value!r}: a step's seconds (finite, >= 0) or -1 "
                "for none"
            )


def check_tables(
    name: str,
    tables: Mapping[str, Any],
    units: Mapping[int, tuple[int, torch.dtype]] | None = None,
) -> None:
    """Every tensor of the per-unit ``tables`` (``{"residuals": {key: tensor}, ...}``, as a
    memory saves them) is a tensor of finite values; with ``units`` (key -> elements and dtype
    of the unit's gradient), of a key in it, with that many elements of that dtype.

    Raises:
        ValueError: naming the table, the key and what is wrong (``name``: where the tables
            are in the checkpoint).
    """
    for table, entries in tables.items():
        if not isinstance(entries, Mapping):
            continue
        for key, value in entries.items():
            where = f"{name}[{table!r}][{key!r}]"
            if not isinstance(value, Tensor):
                raise ValueError(f"the checkpoint's {where} is not a tensor: {type(value)}")
            if units is not None:
                _check_unit(where, value, units.get(int(key)))
            bad = int((~torch.isfinite(value)).sum()) if value.is_floating_point() else 0
            if bad:
                raise ValueError(
                    f"the checkpoint's {where} holds {bad} non-finite value(s) of "
                    f"{value.numel()}: every step would add them to the gradient and be "
                    "skipped; save it again from a finite state"
                )


def _check_unit(where: str, value: Tensor, unit: tuple[int, torch.dtype] | None) -> None:
    if unit is None:
        raise ValueError(f"the checkpoint's {where} belongs to no bucket of this optimizer")
    numel, dtype = unit
    if value.numel() != numel or value.dtype != dtype:
        raise ValueError(
            f"the checkpoint's {where} has {value.numel()} elements of {value.dtype}; its "
            f"bucket's gradient has {numel} of {dtype}"
        )


def check_compatible(
    state: Mapping[str, Any],
    *,
    topology: Topology,
    compressor: str,
    controller_kind: str,
    policy: str,
) -> None:
    """``state`` was saved by an engine like this one: aggregating in the same nodes
    (``topology``: residuals are of a node's chunks), with the same compressor (``compressor``:
    its ``repr``, name and options) and a controller of the same kind (``controller_kind``, or
    a window search for a window search; ``policy``: the policy's ``repr``, for the message).

    Raises:
        ValueError: naming what differs and how to resume.
    """
    nodes = state.get("ranks_per_node", 1)
    if nodes != topology.ranks_per_node:
        raise ValueError(
            f"the checkpoint was saved with ranks_per_node={nodes}, this optimizer "
            f"aggregates in {topology}: its residuals are of other chunks; resume "
            f"with ranks_per_node={nodes}"
        )
    saved = state.get("compressor_config")
    if saved is not None and saved != compressor:
        raise ValueError(
            f"the checkpoint was saved with compressor {saved}, this one has "
            f"{compressor}: its compressor state and residuals do not apply"
        )
    kind = controller_kind
    saved_kind = _saved_kind(state)
    unwindowed = "current" not in state.get("controller", {})
    if saved_kind is None and kind in _WINDOW_SEARCHES and unwindowed:
        saved_kind = "another controller"  # saved before the kind was: no window search
    if (
        saved_kind is not None
        and saved_kind != kind
        and not ({saved_kind, kind} <= _WINDOW_SEARCHES)
    ):
        raise ValueError(
            f"the checkpoint was saved by {saved_kind}, this optimizer runs {kind} "
            f"({policy}): its search state does not apply; build the "
            "optimizer with the policy and search options it was saved with"
        )


def check_controller_state(probe: Controller, saved: object) -> None:
    """The saved controller state loads into ``probe``, a fresh controller like the engine's
    (a dry run on a copy: nothing of the engine changes).

    Raises:
        ValueError: it does not, naming what is missing or wrong.
    """
    try:
        probe.load_state_dict(copy.deepcopy(saved))  # type: ignore[arg-type]
    except KeyError as exc:
        raise ValueError(f"the checkpoint's controller state is missing {exc}") from None
    except (TypeError, AttributeError, IndexError) as exc:
        raise ValueError(f"the checkpoint's controller state does not load: {exc}") from None


def interval_norms(state: Mapping[str, Any]) -> dict[str, Any]:
    """The interval's gradient sums a checkpoint holds: the engine's, or, saved before the
    engine kept them, Accordion's (none for other controllers)."""
    if "interval_norms" in state:
        return dict(state["interval_norms"])
    accordion = state.get("controller", {}).get("accordion", {})
    return {"acc": accordion.get("acc", {}), "tracked": accordion.get("tracked", [])}


def _saved_kind(state: Mapping[str, Any]) -> str | None:
    """The controller kind a checkpoint was saved by (``None``: not recorded)."""
    kind = state.get("controller_kind")
    if kind == _OLD_KIND:
        fixed = state.get("controller", {}).get("phase") == STATIC_PHASE
        return StaticController.__name__ if fixed else PaperController.__name__
    return None if kind is None else str(kind)
