"""Checks of a saved engine state, run before anything is loaded (docs/design.md section 13).

A checkpoint that cannot resume training must say so when it is loaded, naming what is wrong,
rather than load and fail later: a missing key, a residual of another size or dtype than the
bucket it belongs to (every later step would raise), or a non-finite residual (every later
step would be skipped, the parameters frozen for ever).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["REQUIRED_KEYS", "check_keys", "check_tables"]

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
