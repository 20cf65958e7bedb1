"""The compressor's statistics agreed over ranks before it compresses (THC's and the casts'
scales, chunked Top-k's chunk norms: :class:`gravac.compressors.base.Agreeing`), and those that
may lag a step (docs/design.md section 4).

A compressor whose statistics must be exact at each step gets them in one blocking collective
per unit. One whose :class:`~gravac.compressors.base.StatsRule` allows lagging statistics under
error feedback compresses with the ones agreed at the previous step (the step's own ride with its
scalars, :meth:`Engine.close`), and blocks only at a unit's first step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gravac.comm import Communicator
from gravac.compressors.base import Agreeing, Compressor, Round, stats_rule
from gravac.engine.records import Step

__all__ = ["AgreedStats"]

#: the layer ids of a unit or piece: what its lagging statistics are kept by
_Layers = tuple[int, ...]


class AgreedStats:
    """Agrees a compressor's statistics over ranks, and keeps the lagging ones.

    Args:
        compressor: the engine's compressor (one that is not :class:`Agreeing` agrees none).
        feedback: whether residuals keep what a stale statistic clamps (error feedback): only
            then may statistics lag.
    """

    def __init__(self, compressor: Compressor, *, feedback: bool) -> None:
        self.compressor = compressor
        self.rule = stats_rule(compressor)  # how they are reduced (None: it agrees none)
        # the statistics agreed at the last step, by the layers of their unit or piece
        self.lagged: dict[_Layers, Tensor] = {}
        self.lag = self.rule is not None and self.rule.may_lag and feedback

    @property
    def shows_nonfinite(self) -> bool:
        """Whether the statistics are the non-finite check of ``x``."""
        return self.rule is not None and self.rule.shows_nonfinite

    def rounds(
        self,
        step: Step,
        x: Tensor,
        cfs: list[float],
        base: Round,
        layers: _Layers,
        peers: Communicator,
    ) -> list[Round]:
        """One round per CF, with the statistics reduced over ``peers``: one blocking
        collective for all of them; none for a compressor without statistics, nor for one
        whose statistics may lag once a step has agreed them (:attr:`lagged`). The step's own
        lagging statistics and a non-finite check they stand for go into ``step``."""
        c, rule = self.compressor, self.rule
        if not isinstance(c, Agreeing) or rule is None:
            return [base] * len(cfs)
        stats = [c.local_stats(x, cf, base) for cf in cfs]
        present = [s for s in stats if s is not None]
        if not present:
            return [base] * len(cfs)
        flat = torch.cat([s.reshape(-1).to(torch.float64) for s in present])
        if rule.shows_nonfinite:  # the non-finite check of x, without a pass of its own
            step.ends.append(flat.clone())
        stale = False
        if self.lag:
            step.stats.append((layers, flat))
            lagged = self.lagged.get(layers)
            stale = lagged is not None and lagged.numel() == flat.numel()
            if stale and lagged is not None:
                flat = lagged
        if not stale:
            name = f"unit {base.key}'s compressor statistics"
            peers.all_reduce_([flat], op=rule.op, name=name, step=step.index)
        out, offset = [], 0
        for s in stats:
            if s is None:
                out.append(base)
                continue
            agreed = flat[offset : offset + s.numel()].view(s.shape).to(s.dtype)
            offset += s.numel()
            out.append(dataclasses.replace(base, agreed=agreed, stale=stale))
        return out

    def keep(self, step: Step, table: Tensor) -> None:
        """Reduce the step's lagging statistics over ranks (``table``: every rank's row of
        them), for the next step."""
        op = "sum" if self.rule is None else self.rule.op
        offset = 0
        for layers, local in step.stats:
            cols = table[:, offset : offset + local.numel()]
            offset += local.numel()
            self.lagged[layers] = cols.amax(dim=0) if op == "max" else cols.sum(dim=0)

    def relayer(self, layers: Mapping[int, int]) -> None:
        """Move the lagging statistics with their tensors' new layer ids (``layers``: old ->
        new); drop those of tensors no longer compressed."""
        self.lagged = {
            tuple(layers[k] for k in key): v
            for key, v in self.lagged.items()
            if all(k in layers for k in key)
        }

    def rescale(self, factor: float) -> None:
        """The gradients' unit changed by ``factor`` (a loss scale): the lagging statistics
        in the new unit (``factor ** degree`` times, :class:`StatsRule`)."""
        if self.rule is not None:
            for t in self.lagged.values():
                t.mul_(factor**self.rule.degree)

    def state_dict(self) -> list[tuple[list[int], list[float]]]:
        """The lagging statistics, by layers, as lists."""
        return [(list(k), v.tolist()) for k, v in self.lagged.items()]

    def load_state_dict(self, state: list[Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.lagged = {tuple(k): torch.tensor(v, dtype=torch.float64) for k, v in state}
