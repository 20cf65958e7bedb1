"""The scalars every rank sends with a step, and the table of every rank's.

Besides its payloads, a step exchanges one float64 row per rank, all-gathered in one
asynchronous collective (:meth:`gravac.engine.Engine.close`)::

    [nonfinite, stale, interval, exposed, bound, step, layout, sparse, dropped | has_grad x F
     | terms x T | values x V | stats]

* ``nonfinite``: this rank saw a non-finite gradient (1) or not (0);
* ``stale``: this rank changed a gradient after it was launched;
* ``interval``: the previous step's seconds, from the end of the step before it to its own
  end (-1: not timed);
* ``exposed``: the previous step's exposed communication seconds (-1: none);
* ``bound``: a bound on ``max |x|`` over this rank's compressed units (``inf``: none known);
* ``step``: the step's index on this rank (ranks that loaded checkpoints of different steps
  differ);
* ``layout``: a digest of the parameter layout this rank trains, or would train from the next
  step on (:func:`layout_check`): a rank that changed its parameters alone differs;
* ``sparse``: the index, among the front end's parameters, of the first tensor this rank has a
  sparse gradient for (-1: none), which the dense buckets cannot carry;
* ``dropped``: this rank drops the step (its front end discarded the gradients launched, as
  ``GravacOptimizer.zero_grad()`` after a backward pass without a step does);
* ``has_grad``: per tensor, whether this rank has its gradient (:attr:`Unit.slots`);
* ``terms``: the local gain terms (:class:`Terms`), summed over the compressed units;
* ``values``: what the plan asks this rank to send for the controller (under Accordion's plans,
  the learning rate and the interval norms, :meth:`gravac.engine.Engine._local_values`);
* ``stats``: compressor statistics whose reduction may lag a step (THC's norms).

Every rank reads the same table, so every decision taken from it is the same on every rank.
The ``step`` and ``layout`` columns check, at every step and at no cost but 16 bytes, that the
ranks still train alike (issue 33): a difference raises the same named error on every rank,
where a collective of its own, run by the ranks that changed only, would hang or abort the
group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gravac.agreement import digest
from gravac.gain import gain_from_terms

__all__ = [
    "STEP_TERMS",
    "Row",
    "SparseGradientError",
    "Table",
    "Terms",
    "layout_check",
    "terms_size",
]

#: gain terms every step carries: ``<c_min, x>, ||c_min||^2, <c_c, x>, ||c_c||^2, ||x||^2``
#: (the CFs compressed at, :mod:`gravac.gain`), then the window's ``<S, X>, ||S||^2, ||X||^2``
#: (:mod:`gravac.control.window`, at a step that closes a window)
STEP_TERMS = 8
#: terms each of a plan's shadow CFs adds after them (:mod:`gravac.control.replay`)
TERMS_PER_SHADOW = 3
#: the scalars before the has-gradient flags: nonfinite, stale, interval, exposed, bound,
#: step, layout, sparse, dropped
_HEAD = 9
#: the columns of the step index, the layout digest, the first sparse gradient's index and
#: the dropped flag
_STEP, _LAYOUT, _SPARSE, _DROPPED = 5, 6, 7, 8
#: bits of the layout digest the row carries: a float64 holds integers below 2**53 exactly
_LAYOUT_BITS = 52


class SparseGradientError(ValueError):
    """Some rank had a sparse gradient, which the dense buckets cannot carry: raised by
    :meth:`Engine.commit` on every rank alike (a front end names the parameter its own way).

    Attributes:
        index: the lowest parameter index (the front end's order) any rank had one for.
        ranks: the ranks that had one.
    """

    def __init__(self, index: int, ranks: list[int]) -> None:
        super().__init__(
            f"rank(s) {ranks} had a sparse gradient for parameter {index}: gravac's buckets "
            "carry dense (torch.strided) gradients only"
        )
        self.index = index
        self.ranks = ranks


def layout_check(text: str) -> int:
    """The digest of a layout's text (:func:`gravac.agreement.layout_text`) that a row
    carries: the low :data:`_LAYOUT_BITS` bits of its 64-bit digest, exact in a float64."""
    return digest(text) & ((1 << _LAYOUT_BITS) - 1)


def terms_size(shadows: int) -> int:
    """How many gain terms a step carries with ``shadows`` shadow CFs."""
    return STEP_TERMS + TERMS_PER_SHADOW * shadows


@dataclass(frozen=True)
class Terms:
    """A step's gain terms, summed over units and ranks, by name (see :data:`STEP_TERMS`)."""

    values: Tensor

    @property
    def gain_min(self) -> float:
        """The gain of what was compressed at ``theta_min``."""
        return gain_from_terms(self.values[[0, 1, 4]])

    @property
    def gain_candidate(self) -> float:
        """The gain of what was compressed at the candidate CF."""
        return gain_from_terms(self.values[[2, 3, 4]])

    @property
    def gain_window(self) -> float:
        """The gain of the window that ended before the step."""
        return gain_from_terms(self.values[5:STEP_TERMS])

    def shadow_gains(self, shadows: Sequence[float]) -> dict[float, float]:
        """The window gain of each of the plan's ``shadows``, in order."""
        k = TERMS_PER_SHADOW
        return {
            cf: gain_from_terms(self.values[STEP_TERMS + k * i : STEP_TERMS + k * (i + 1)])
            for i, cf in enumerate(shadows)
        }


@dataclass(frozen=True)
class Row:
    """One rank's scalars of a step (see the module docstring)."""

    nonfinite: bool
    stale: bool
    interval: float
    exposed: float
    bound: float
    step: int
    layout: int
    sparse: int
    has_grad: Sequence[bool]
    terms: Tensor
    values: Tensor
    stats: Sequence[Tensor]
    dropped: bool = False

    def pack(self, device: torch.device) -> Tensor:
        """The row as one float64 tensor on ``device``, to all-gather."""
        head = [self.nonfinite, self.stale, self.interval, self.exposed, self.bound]
        head += [self.step, self.layout, self.sparse, self.dropped]
        scalars = torch.tensor([*head, *self.has_grad], dtype=torch.float64)
        stats = [s.cpu() for s in self.stats]
        return torch.cat([scalars, self.terms.cpu(), self.values, *stats]).to(device)


@dataclass(frozen=True)
class Table:
    """Every rank's :class:`Row` of a step, one row each (float64, on the CPU), read by name.

    Attributes:
        rows: the gathered rows.
        flags: has-gradient flags per row.
        terms: gain terms per row.
        values: controller values per row.
    """

    rows: Tensor
    flags: int
    terms: int
    values: int

    @property
    def stale_ranks(self) -> list[int]:
        """The ranks that changed a gradient after it was launched."""
        return [r for r in range(self.rows.shape[0]) if self.rows[r, 1] > 0]

    @property
    def any_stale(self) -> bool:
        """Whether some rank changed a gradient after it was launched."""
        return bool(self.rows[:, 1].max() > 0)

    @property
    def dropped_ranks(self) -> list[int]:
        """The ranks that drop the step."""
        return [r for r in range(self.rows.shape[0]) if self.rows[r, _DROPPED] > 0]

    @property
    def all_dropped(self) -> bool:
        """Whether every rank drops the step."""
        return bool(self.rows[:, _DROPPED].min() > 0)

    @property
    def any_nonfinite(self) -> bool:
        """Whether some rank saw a non-finite gradient."""
        return bool(self.rows[:, 0].max() > 0)

    @property
    def interval(self) -> float:
        """The longest time of the previous step over ranks, end to end (-1: not timed)."""
        return float(self.rows[:, 2].max())

    @property
    def exposed(self) -> float:
        """The longest exposed communication of the previous step over ranks (-1: none)."""
        return float(self.rows[:, 3].max())

    @property
    def bound(self) -> float:
        """A bound on ``max |x|`` over every rank."""
        return float(self.rows[:, 4].max())

    def differing(self, column: int) -> list[int]:
        """The ranks whose value in ``column`` differs from rank 0's."""
        values = self.rows[:, column]
        return [r for r in range(self.rows.shape[0]) if values[r] != values[0]]

    @property
    def steps(self) -> list[int]:
        """Every rank's step index."""
        return [int(v) for v in self.rows[:, _STEP]]

    @property
    def other_step_ranks(self) -> list[int]:
        """The ranks at another step than rank 0."""
        return self.differing(_STEP)

    @property
    def other_layout_ranks(self) -> list[int]:
        """The ranks with another parameter layout (now or from the next step) than rank 0's."""
        return self.differing(_LAYOUT)

    @property
    def sparse_ranks(self) -> list[int]:
        """The ranks that had a sparse gradient."""
        return [r for r in range(self.rows.shape[0]) if self.rows[r, _SPARSE] >= 0]

    @property
    def first_sparse(self) -> int:
        """The lowest parameter index any rank had a sparse gradient for (-1: none)."""
        found = [int(v) for v in self.rows[:, _SPARSE] if v >= 0]
        return min(found, default=-1)

    def disagreement(self, step: int) -> Exception | None:
        """The error every rank raises at ``step`` when the table shows the ranks cannot
        step together (``None``: they can): ranks at different steps, training different
        parameters, dropping the step on some ranks only, a sparse gradient on some rank, or a
        gradient changed after its launch (the last two do not matter to a step every rank
        drops)."""
        if self.other_step_ranks:
            return ValueError(
                f"the ranks are at different steps {self.steps} (by rank): rank(s) "
                f"{self.other_step_ranks} differ from rank 0. Did the ranks load "
                "checkpoints of different steps? Load the same step's checkpoint on every rank"
            )
        if self.other_layout_ranks:
            return ValueError(
                f"rank(s) {self.other_layout_ranks} train other parameters than rank 0 "
                f"at step {step}, or from the next step on (order, shapes, dtypes, "
                "requires_grad): a group added, or a tensor frozen or unfrozen, on some "
                "ranks only. Every rank must change its parameters alike, before the same step"
            )
        dropped = self.dropped_ranks
        if dropped:  # every rank's gradients go, whatever they held; or a rank is alone
            if len(dropped) == self.rows.shape[0]:
                return None
            return RuntimeError(
                f"rank(s) {dropped} dropped step {step} (zero_grad() after a backward pass "
                "had launched its gradients, without a step), the others stepped it: every "
                "rank must step, or zero the gradients, alike"
            )
        if self.sparse_ranks:
            return SparseGradientError(self.first_sparse, self.sparse_ranks)
        if self.any_stale:
            return RuntimeError(
                f"rank(s) {self.stale_ranks} changed a gradient after its bucket had been "
                "sent during backward(), so the change would be lost: call "
                "opt.synchronize() before working on gradients (clipping, unscaling), "
                "accumulate inside opt.no_sync(), drop the gradients of a backward pass that "
                "no step used with opt.zero_grad() (model.zero_grad() does not know them), or "
                "pass overlap=False. A model wrapped in DistributedDataParallel does this at "
                "every step (DDP writes its own average into the gradients): do not wrap it, "
                "or keep DDP and use gravac.ddp.gravac_hook instead of the optimizer"
            )
        return None

    @property
    def present(self) -> tuple[bool, ...]:
        """For each has-gradient flag, whether some rank had that gradient."""
        flags = self.rows[:, _HEAD : _HEAD + self.flags]
        return tuple(bool(v) for v in (flags.max(dim=0).values > 0))

    @property
    def summed_terms(self) -> Terms:
        """The gain terms summed over ranks."""
        start = _HEAD + self.flags
        return Terms(self.rows[:, start : start + self.terms].sum(dim=0))

    @property
    def controller_values(self) -> Tensor:
        """Every rank's controller values (one row each)."""
        start = _HEAD + self.flags + self.terms
        return self.rows[:, start : start + self.values]

    @property
    def stats(self) -> Tensor:
        """Every rank's lagging compressor statistics (one row each)."""
        return self.rows[:, _HEAD + self.flags + self.terms + self.values :]
