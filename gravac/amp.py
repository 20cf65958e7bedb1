"""Mixed precision with :class:`GravacOptimizer`: a ``torch.amp.GradScaler`` that aggregates first.

``torch.amp.GradScaler`` multiplies the loss by a scale ``S`` before backward, then checks the
gradients for Inf/NaN, unscales them (``g / S``) and steps unless it found any; it halves ``S``
after such a step (backoff) and doubles it after ``growth_interval`` clean steps (growth). Under
:class:`GravacOptimizer` the gradients are sent during backward, so torch's scaler would check
and unscale each rank's own gradients after they were sent: the update would use scaled
aggregates, and a rank that alone found Inf would back off alone, its scale then differing from
the others'. :class:`GradScaler` calls :meth:`GravacOptimizer.synchronize` first: it checks and
unscales the aggregates, identical on every rank (a step skipped for a non-finite value on any
rank is NaN on every rank), so every rank finds the same and keeps the same scale.

Error feedback keeps residuals in the unit of the gradients they came from, ``S`` times the
true one. When ``update()`` changes the scale from ``S`` to ``S'``, :class:`GradScaler` multiplies
what the optimizers it stepped keep in that unit by ``S' / S`` (:meth:`GravacOptimizer.rescale`),
so that the next ``x = g + e`` adds terms of one unit. Growth and backoff factors are powers of
two by default: then every product is exact, and training with a scaler is bit for bit training
unscaled gradients (steps with Inf/NaN skipped alike). Through gravac's DDP comm hook the
aggregates reach the optimizer already, as with plain DDP; the hook's residuals are rescaled
likewise where the scaler is given its state (``GradScaler(hooks=[state])``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gravac.ddp import GravacHookState
from gravac.optimizer import GravacOptimizer

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for :class:`GravacOptimizer` (and any other optimizer, which
    it treats as torch's does); the same arguments, the same loop::

        scaler = gravac.amp.GradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)          # optional: clip here, on the aggregates
        scaler.step(opt)
        scaler.update()

    ``unscale_(opt)`` and ``step(opt)`` aggregate the step first (``opt.synchronize()``) where
    it is not yet; ``update()`` rescales the optimizers' error feedback to the new scale.

    Args:
        *args, **kwargs: ``torch.amp.GradScaler``'s.
        hooks: the states of gravac's DDP comm hook (:class:`gravac.ddp.GravacHookState`)
            that backward runs through this scaler's scaled losses: ``update()`` rescales
            their error feedback too (DDP hands any optimizer aggregates already, so the
            scaler checks and unscales them as torch's does).
    """

    def __init__(self, *args: Any, hooks: Sequence[GravacHookState] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not all(isinstance(h, GravacHookState) for h in hooks):
            raise ValueError(f"hooks must be GravacHookState objects, got {list(hooks)!r}")
        self.hooks = tuple(hooks)
        # the optimizers stepped or unscaled since the last update(), whose residuals hold
        # the scale of this step's backward
        self._stepped: list[weakref.ref[GravacOptimizer]] = []

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Aggregate ``optimizer``'s step first (a :class:`GravacOptimizer`), then unscale
        the aggregates as ``torch.amp.GradScaler.unscale_`` does."""
        self._synchronize(optimizer)
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Aggregate ``optimizer``'s step first (a :class:`GravacOptimizer`), then check,
        unscale and step as ``torch.amp.GradScaler.step`` does."""
        self._synchronize(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale as ``torch.amp.GradScaler.update`` does; where it changed from
        ``S`` to ``S'``, multiply the error feedback of every :class:`GravacOptimizer`
        stepped since the last update, and of :attr:`hooks`, by ``S' / S``
        (:meth:`GravacOptimizer.rescale`, :meth:`GravacHookState.rescale`)."""
        if not self.is_enabled():
            return
        before = self.get_scale()
        super().update(new_scale)
        after = self.get_scale()
        stepped, self._stepped = self._stepped, []
        if after == before:
            return
        for ref in stepped:
            opt = ref()
            if opt is not None:
                opt.rescale(after / before)
        for hook in self.hooks:
            hook.rescale(after / before)

    def _synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        """Aggregate a :class:`GravacOptimizer`'s step if it is not yet, and remember it for
        :meth:`update`."""
        if not (self.is_enabled() and isinstance(optimizer, GravacOptimizer)):
            return
        if not optimizer.synchronized:
            optimizer.synchronize()
        if all(ref() is not optimizer for ref in self._stepped):
            self._stepped.append(weakref.ref(optimizer))
