"""Error feedback (EF): the residual memory kept beside any compressor.

Each step the residual of what was not sent is added back (Seide et al. 2014; Stich et al. 2018;
docs/design.md section 5)::

    x = g + e            (compensate)
    send C(x)
    e <- x - D(C(x))     (update)

so that ``g + e_old == D(C(x)) + e_new`` holds exactly. Residuals are keyed by bucket (an ``int``
that is the same on every rank) and never shared between ranks.

A memory reads a compressor only through :class:`Sender` (what was sent, densely, and the
residual it leaves), so this module depends on no compressor: compressors build their memory
(:meth:`gravac.compressors.base.Compressor.make_memory`), not the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["Memory", "NoMemory", "ResidualMemory", "Sender"]


class Sender(Protocol):
    """What error feedback reads of a compressor (:class:`gravac.compressors.base.Compressor`):
    ``payload`` and ``ctx`` are that compressor's payload record and local context."""

    def decompress(self, payload: Any, ctx: Any) -> Tensor:
        """``D(C(x))``: the dense tensor that ``payload`` sends."""
        ...

    def residual_(self, x: Tensor, payload: Any, ctx: Any) -> Tensor:
        """``x - D(C(x))``, in ``x``'s storage."""
        ...


class Memory:
    """Interface of an error-feedback memory (GRACE's "memory" abstraction)."""

    def compensate(self, key: int, g: Tensor) -> Tensor:
        """The tensor to compress this step for the gradient ``g`` of bucket ``key``."""
        return g

    def compensate_(self, key: int, g: Tensor) -> Tensor | None:
        """:meth:`compensate` in ``g``'s own storage, for a caller that gives ``g`` up (the
        optimizer's gradient buffer); ``None``: this memory cannot (it keeps more than a
        residual), the caller uses :meth:`compensate`."""
        return None

    def addend(self, key: int, g: Tensor) -> Tensor | None:
        """What :meth:`compensate_` would add to ``g``, for a caller that adds it while it
        writes the gradient into ``g``'s storage: ``x = g + e`` in one pass, not a copy and
        an addition. ``None``: nothing to add, or this memory compensates otherwise (the caller
        writes the gradient alone and :meth:`compensate_` runs)."""
        return None

    def update(self, key: int, x: Tensor, sent: Tensor) -> None:
        """Record that ``sent`` (dense, ``D(C(x))``) was sent for the compensated ``x``."""

    def update_sent(self, key: int, x: Tensor, compressor: Sender, payload: Any, ctx: Any) -> None:
        """Record that ``payload`` (compressed by ``compressor`` from ``x``) was sent: the same
        as :meth:`update` with its dense decompression, which memories that only keep the
        residual avoid (:meth:`Compressor.residual_`); ``x`` is consumed."""
        self.update(key, x, compressor.decompress(payload, ctx))

    def settle(
        self, key: int, x: Tensor, compressor: Sender, payload: Any, ctx: Any
    ) -> Tensor | None:
        """The residual that sending ``payload`` for ``x`` leaves, computed *before* it is sent
        (``x`` is consumed) but kept only by :meth:`keep`, once the step is committed; ``None``:
        this memory reads the payload at commit instead (:meth:`update_sent`).

        Computing it before the send lets an all-reduce sum into the payload itself (nothing
        reads it afterwards) and keeps a skipped step's residual untouched.
        """
        return None

    def keep(self, key: int, residual: Tensor) -> None:
        """Make ``residual``, returned by :meth:`settle`, bucket ``key``'s residual.

        Raises:
            NotImplementedError: a memory whose :meth:`settle` returns ``None``.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no residual from settle()")

    def swap(self, key: int, residual: Tensor) -> Tensor | None:
        """As :meth:`keep`, but the old residual is handed back for the caller to reuse, not
        kept (``None``: there was none, or ``residual`` already is it).

        Raises:
            NotImplementedError: a memory whose :meth:`settle` returns ``None``.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no residual from settle()")

    def reset(self, key: int | None = None) -> None:
        """Forget the residual of ``key`` (all keys when ``None``), e.g. after a dense step."""

    def rescale(self, factor: float) -> None:
        """Multiply everything kept in gradient units by ``factor``, for gradients whose unit
        changed between steps (a loss scale, :class:`gravac.amp.GradScaler`): ``e <- factor *
        e``. Nothing to do here; a memory that keeps such state overrides it."""

    def residual(self, key: int) -> Tensor | None:
        """The error not yet sent for bucket ``key`` (``None`` if there is none)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class NoMemory(Memory):
    """No error feedback: what is not sent is dropped (for baselines and ablations)."""

    def update_sent(self, key: int, x: Tensor, compressor: Sender, payload: Any, ctx: Any) -> None:
        """Nothing to keep."""


class ResidualMemory(Memory):
    """Plain residual error feedback: ``x = g + e``; ``e <- x - sent``.

    Residuals keep the gradient's dtype and device. A residual whose shape no longer matches its
    key's gradient is an error (the caller re-keys residuals when bucket layouts change).
    """

    def __init__(self) -> None:
        self.residuals: dict[int, Tensor] = {}
        # per key, the storage of a residual replaced by update_sent(): the next compensate()
        # writes g + e into it instead of allocating (no page faults on a fresh buffer), so a
        # bucket holds two gradient-sized buffers: the residual and this one
        self._spare: dict[int, Tensor] = {}

    def compensate(self, key: int, g: Tensor) -> Tensor:
        e = self._matching(key, g)
        if e is None:
            return g.clone()
        spare = self._spare.pop(key, None)
        if spare is None or spare.shape != g.shape or spare.dtype != g.dtype:
            return g + e
        return torch.add(g, e, out=spare)

    def compensate_(self, key: int, g: Tensor) -> Tensor:
        """``g += e``: ``x`` in ``g``'s storage."""
        e = self._matching(key, g)
        return g if e is None else g.add_(e)

    def addend(self, key: int, g: Tensor) -> Tensor | None:
        """The residual ``e`` (``None`` before the first step)."""
        return self._matching(key, g)

    def _matching(self, key: int, g: Tensor) -> Tensor | None:
        e = self.residuals.get(key)
        if e is not None and (e.shape != g.shape or e.dtype != g.dtype):
            raise ValueError(
                f"residual of bucket {key} has shape {tuple(e.shape)} and dtype {e.dtype}, "
                f"gradient has {tuple(g.shape)} and {g.dtype}"
            )
        return e

    def update(self, key: int, x: Tensor, sent: Tensor) -> None:
        self.residuals[key] = x - sent

    def update_sent(self, key: int, x: Tensor, compressor: Sender, payload: Any, ctx: Any) -> None:
        self.keep(key, self.settle(key, x, compressor, payload, ctx))

    def settle(self, key: int, x: Tensor, compressor: Sender, payload: Any, ctx: Any) -> Tensor:
        """``x - D(payload)`` in ``x``'s storage (:meth:`Compressor.residual_`)."""
        return compressor.residual_(x, payload, ctx)

    def keep(self, key: int, residual: Tensor) -> None:
        """The new residual replaces the old one, whose storage the next :meth:`compensate`
        reuses."""
        old = self.residuals.get(key)
        self.residuals[key] = residual
        if old is not None and old is not residual:
            self._spare[key] = old

    def swap(self, key: int, residual: Tensor) -> Tensor | None:
        old = self.residuals.get(key)
        self.residuals[key] = residual
        self._spare.pop(key, None)
        return old if old is not residual else None

    def reset(self, key: int | None = None) -> None:
        if key is None:
            self.residuals.clear()
            self._spare.clear()
        else:
            self.residuals.pop(key, None)
            self._spare.pop(key, None)

    def residual(self, key: int) -> Tensor | None:
        return self.residuals.get(key)

    def rescale(self, factor: float) -> None:
        for e in self.residuals.values():
            e.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {int(k): torch.as_tensor(v).clone() for k, v in state["residuals"].items()}
