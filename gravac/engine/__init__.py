"""The step engine: one per-bucket pipeline behind both front ends (docs/design.md section 4).

:class:`gravac.GravacOptimizer` and the DDP comm hook (:mod:`gravac.ddp`) hand the engine flat
gradients, one *unit* at a time (a compressed bucket, or a dense one of 1-D tensors), as soon
as each is ready; the engine does the rest. For every step::

    begin:   plan = controller.plan(); the decision is plan.send
             (agreed through step t - 1, docs/design.md section 8: known before any gradient)
    launch:  x = g + e                                      (error feedback, per unit)
             X_min = C(x, theta_min); X_c = C(X_min, theta_c / theta_min)   (multi-level)
             local gain terms <c, x>, ||c||^2 (from the payload), ||x||^2
             e' = x - D(sent), in x's storage (settled now, kept at commit; where a tensor of
             the unit has no gradient, at commit), so nothing reads x or the payload later
             start the collective of what the decision names, an all-reduce in place (a
             future completes with the unit's aggregate at commit)
    close:   one small all-gather of the step's scalars [non-finite flag, step time, bound
             on |x|, step index, layout digest, dropped flag, has-gradient flags, gain
             terms], overlapped with the payloads in flight
    commit:  ranks at different steps, or with different layouts, or dropping the step on
             some ranks only: raise on every rank; every rank dropping it: drop it
    commit:  any rank non-finite: skip; else combine every unit's payloads into the mean
             over ranks in its ``out`` buffer (the front end's gradient buffer: no gradient-
             sized temporary); a non-finite mean: skip (a mean that the compressor bounds well
             inside the range, from the agreed bound on every rank's |x|, is not looked at:
             Compressor.mean_bound). A skip leaves residuals, compressor and controller
             untouched on every rank (aggregates NaN); else e <- e', and the agreed gains and
             step time are shown to the controller (controller.observe(Observation(...))).
             A front end that hands its buffer over (``launch(..., Given())``, the
             optimizer) has x formed in it; it becomes the residual and the mean lands in the
             old residual's storage: two gradient-sized buffers a unit, where a buffer of x's
             own would make three
    finish:  count and log the step

Units must be launched in the same order on every rank (collectives pair up by order). The
decision never waits for the step's own gains, so each unit's collective starts while backward
is still computing the next one's gradient; the only values exchanged per step besides the
payloads are those few scalars, in one asynchronous collective.

The package: :mod:`gravac.engine.core` (the :class:`Engine`: its state and the order of a
step's stages), and the parts it calls: :mod:`gravac.engine.records` (units, how a buffer is
handed over, what is in flight, the step and its outcome), :mod:`gravac.engine.scalars` (the
row of scalars every rank sends, the table of every rank's, and the errors it raises),
:mod:`gravac.engine.stats` (a compressor's statistics agreed over ranks, and those that lag),
:mod:`gravac.engine.finite` (the non-finite flag and the bound on ``max |x|`` a rank sends),
:mod:`gravac.engine.flights` (a unit's aggregate and residual update at commit),
:mod:`gravac.engine.observe` (what a step shows the controller and the log) and
:mod:`gravac.engine.checkpoint` (what a saved state must hold and match).
"""

from gravac.engine.core import Engine
from gravac.engine.finite import all_finite
from gravac.engine.records import Given, Handover, Lent, Outcome, Step, Unit
from gravac.engine.scalars import SparseGradientError, layout_check

__all__ = [
    "Engine",
    "Given",
    "Handover",
    "Lent",
    "Outcome",
    "SparseGradientError",
    "Step",
    "Unit",
    "all_finite",
    "layout_check",
]
