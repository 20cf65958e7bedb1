"""Each layer's gradient summed over an interval of steps, for Accordion's regimes.

Accordion (Agarwal et al., MLSys 2021) compares, per layer, the norm of the gradient accumulated
over an interval with the previous interval's (:mod:`gravac.control.searches.accordion`). The engine
keeps the sums while a plan asks for them (:attr:`gravac.control.records.Plan.norms`): each
compressed unit's uncompressed local gradient is added at launch, by the layers' stable ids
(:attr:`gravac.engine.Unit.layer_ids`), and at an interval's last step every rank's norms travel
with the step's scalars, so the search sees their mean over ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gravac.control.window import rekeyed

__all__ = ["IntervalNorms"]


class IntervalNorms:
    """The sums of an interval's gradients, by layer, in the order the layers were launched."""

    def __init__(self) -> None:
        self._acc: dict[int, Tensor] = {}  # layer -> its gradients summed over the interval
        self._tracked: dict[int, None] = {}  # layers added this interval, in launch order

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers added this interval, in launch order (identical on every rank)."""
        return tuple(self._tracked)

    def add(self, layers: tuple[int, ...], grad: Tensor, numels: tuple[int, ...]) -> None:
        """Add a unit's flat uncompressed local gradient: the tensors ``layers`` of ``numels``
        elements (read now: it changes at commit). A layer's buffer is kept from interval to
        interval, in at least float32."""
        parts = grad.detach().reshape(-1).split(list(numels))
        for layer, part in zip(layers, parts, strict=True):
            acc = self._acc.get(layer)
            if acc is None or acc.numel() != part.numel():
                dtype = torch.promote_types(part.dtype, torch.float32)
                self._acc[layer] = part.to(dtype, copy=True)
            elif layer in self._tracked:
                acc.add_(part)
            else:  # the interval's first gradient: the buffer is reused
                acc.copy_(part)
            self._tracked[layer] = None

    def local_norms(self) -> list[float]:
        """``||sum||`` of each layer added this interval, in launch order."""
        return [float(torch.linalg.vector_norm(self._acc[k])) for k in self._tracked]

    def end_interval(self) -> None:
        """The interval is over: a new one starts; the buffers of layers not added in it go."""
        self._acc = {k: v for k, v in self._acc.items() if k in self._tracked}
        self._tracked = {}

    def relayer(self, layers: Mapping[int, int]) -> None:
        """The layout changed: each layer's sum moves to its new id (``layers``: old -> new);
        a layer no longer compressed has its sum dropped."""
        self._acc = rekeyed(self._acc, layers)
        self._tracked = dict.fromkeys(layers[k] for k in self._tracked if k in layers)

    def rescale(self, factor: float) -> None:
        """Multiply the sums by ``factor`` (the gradients' unit changed: a loss scale)."""
        for acc in self._acc.values():
            acc.mul_(factor)

    def restart(self) -> None:
        """Start the interval again (a step skipped on every rank: its gradients cannot be
        taken back out of the sums)."""
        self._tracked = {}

    def state_dict(self) -> dict[str, Any]:
        """The sums and the layers added, to resume exactly."""
        return {"acc": {k: v.clone() for k, v in self._acc.items()}, "tracked": list(self._tracked)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._acc = {int(k): v.clone() for k, v in state["acc"].items()}
        self._tracked = dict.fromkeys(int(k) for k in state["tracked"])
