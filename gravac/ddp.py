"""gravac as a ``DistributedDataParallel`` communication hook (docs/design.md section 3).

The second front end over the step engine (:mod:`gravac.engine`): DDP fills its buckets during
backward and hands each to the hook, which compresses it with the same engine, controller and
error feedback as :class:`gravac.GravacOptimizer`, and returns a future of the aggregated
bucket. Use it with any optimizer, and through DDP with Lightning and the HF ``Trainer``::

    model = DistributedDataParallel(net)
    state = GravacHookState(compressor="topk", policy="exponential", batch_size=32)
    model.register_comm_hook(state, gravac_hook)

Within a DDP bucket the 1-D tensors (biases, norms) travel dense and the rest is compressed as
one unit. Where a bucket mixes the two (DDP buckets in reverse parameter order), each unit's
tensors are gathered out of the bucket with the residual added, and the engine lays each
aggregate back into the bucket's spans (:mod:`gravac.spans`): sparsifiers and casts write it
there directly, the others copy it. DDP never splits a tensor, so the hook casts a large
layer to 16 bits whole, where the optimizer sends it in pieces of
:data:`gravac.compressors.dense.CAST_BUCKET_BYTES` that pipeline the cast with the wire
(``benchmarks/README.md``, tenth and eleventh measurements).

A step ends at DDP's last bucket: the step's scalars are agreed beside the payloads, the last
bucket's hook waits for everything to arrive and commits the step, and every bucket's future
completes with it (a failed collective raises :class:`gravac.CollectiveError` from
``backward()``, naming the step and the collective; past ``step_timeout``,
:class:`gravac.StepTimeoutError`). A step with a non-finite gradient on any rank cannot be
skipped by a hook (the optimizer runs after it): every rank receives NaN gradients instead, as
plain DDP's all-reduce would give, so that ``GradScaler`` skips the step on every rank;
residuals, compressor and controller stay untouched.

DDP rebuilds its buckets once, after the first iteration: the residuals of the first buckets
are then carried, tensor by tensor, into the new ones (nothing is lost; DGC's momenta restart).
The state pickles into a checkpoint without the process group, the monitor and the clock, as
PyTorch's ``PowerSGDState`` does; or save :meth:`GravacHookState.state_dict`. Residuals are
saved by parameter position (the order of DDP's initial buckets), so register a loaded state
on a fresh DDP model of the same configuration, before its first backward.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gravac.agreement import check_agreement
from gravac.buckets import split_flat
from gravac.config import GravacConfig, build_engine, learning_rate, make_config
from gravac.engine import Engine, Given, Lent, Outcome, Step, Unit
from gravac.engine.checkpoint import check_tables
from gravac.spans import Spans, gather_spans, scatter_spans, spans_numel, spans_of

__all__ = ["GravacHookState", "gravac_hook"]


@dataclass(frozen=True)
class _BucketPlan:
    """How one DDP bucket (its parameters, in buffer order) maps onto engine units.

    Attributes:
        compressed: the unit of its compressed tensors, or ``None``.
        dense: the unit of its 1-D tensors, or ``None``.
        spans: per unit (compressed first), the ``(start, end)`` buffer ranges of its tensors,
            merged where adjacent; empty when the bucket is all one kind (the buffer itself).
        params: the compressed unit's parameters, in order.
        flats: per unit of a bucket with spans, the flat buffer its spans are gathered into,
            reused every step: the last aggregate's (``Engine.launch`` with ``Given``; ``None``: not
            made yet, or the engine's until commit).
    """

    compressed: Unit | None
    dense: Unit | None
    spans: tuple[Spans, ...]
    params: tuple[Tensor, ...]
    flats: list[Tensor | None] = field(default_factory=lambda: [None, None])


class GravacHookState:
    """The state of :func:`gravac_hook`: the engine (compressor, controller, residuals) and how
    DDP's buckets map onto its units.

    Args:
        process_group: the group DDP communicates in (``None``: the default group).
        config: the compression, search and engine options (:class:`gravac.GravacConfig`),
            as :class:`gravac.GravacOptimizer` takes them; ``None``: the defaults.
        **options: :class:`gravac.GravacConfig`'s fields as keywords, replacing the config's.

    The hook sees the model's parameters only as DDP hands its buckets over, so compressors
    whose deliverable CFs depend on the shapes (PowerSGD) plan over them from the second step
    on; the first step compresses at the CF asked for, and its record reports the CF achieved.

    In two levels (``ranks_per_node``, :mod:`gravac.hierarchy`) each unit of a bucket is
    gathered out of it (with the residual pieces carried in, see :meth:`_retire`),
    reduce-scattered inside the node, and its chunk given to the engine once it has arrived;
    the last bucket's hook waits for the rest, commits the step, and all-gathers every unit's
    aggregate inside the node before the buckets' futures complete.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        config: GravacConfig | None = None,
        **options: Any,
    ) -> None:
        self.config = make_config(config, **options)
        self.process_group = process_group
        self.engine: Engine = build_engine(process_group, self.config)
        self.engine.skip_effect = (
            "the hook handed DDP NaN gradients: the optimizer's step applies them (the "
            "parameters become NaN) unless a GradScaler skips it"
        )
        self._step: Step | None = None  # the step whose buckets are being launched
        self._done: Future[Outcome] | None = None  # completes when that step is committed
        self._plans: dict[tuple[int, ...], _BucketPlan] = {}  # by the bucket's parameter ids
        self._units: dict[int, tuple[Tensor, ...]] = {}  # unit key -> its compressed params
        self._next_key = 0  # the key of the next new unit (identical on every rank)
        # each parameter's position in the order DDP first handed them over (its initial
        # buckets, identical in every run of one model and DDP configuration)
        self._position: dict[int, int] = {}
        # residual pieces of units retired by a bucket rebuild, by parameter id
        self._orphans: dict[int, Tensor] = {}
        # residual pieces of a loaded checkpoint, by position, until their parameter appears
        self._loaded: dict[int, Tensor] = {}
        # the shape of each compressed parameter, by position, and those the engine is bound to
        self._shapes: dict[int, torch.Size] = {}
        self._bound: tuple[torch.Size, ...] = ()
        self._optimizer: torch.optim.Optimizer | None = None  # read for its learning rate
        self._checked = False  # whether the ranks agreed on everything since the last load

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Read ``optimizer``'s learning rate at every step (the ``accordion`` policy sends
        every layer at its low CF after a decay); not pickled: call it again after loading."""
        self._optimizer = optimizer

    @property
    def watched(self) -> torch.optim.Optimizer | None:
        """The optimizer :meth:`watch` was given, if any."""
        return self._optimizer

    def rescale(self, factor: float) -> None:
        """Multiply everything kept in the gradients' unit by ``factor``, between steps: the
        residuals (those of retired and loaded buckets too), DGC's momenta and the search's
        sums (:meth:`gravac.engine.Engine.rescale`). For a loss scale that changed by
        ``factor``: ``gravac.amp.GradScaler(hooks=[state])`` calls it.

        Raises:
            RuntimeError: a backward pass is launching a step.
            ValueError: ``factor`` is not a finite number above 0.
        """
        if self._step is not None:
            raise RuntimeError("rescale() between steps only: a backward pass is launching one")
        self.engine.rescale(factor)
        for pieces in (self._orphans, self._loaded):
            for e in pieces.values():
                e.mul_(factor)

    # ------------------------------------------------------------------ the hook
    def hook(self, bucket: dist.GradBucket) -> Future[Tensor]:
        """Launch ``bucket`` and return a future of its aggregate (see :func:`gravac_hook`)."""
        if bucket.buffer().is_sparse:
            return self._sparse(bucket)
        if self._step is None:
            self.engine.join_group()
            if not self._checked:  # the first step, or the first after a load: on every rank
                comm = self.engine.comm
                check_agreement(comm, self.engine.agreement_parts(), comm.device)
                self.engine.form_nodes()
                self._checked = True
            self._bind()
            self._step = self.engine.begin(lr=learning_rate(self._optimizer))
            self._done = Future()
        step, done = self._step, self._done
        assert done is not None
        buffer = bucket.buffer()
        plan = self._plan(bucket.parameters(), buffer)
        first = len(step.flights)
        units = [u for u in (plan.compressed, plan.dense) if u is not None]
        if self.engine.hierarchy is not None:
            return self._hook_chunks(step, done, bucket, plan, units)
        for i, unit in enumerate(units):
            carry = self._orphans_of(plan, buffer) if unit.compressed else None
            if not plan.spans:  # one unit: it receives its aggregate in DDP's own buffer
                self.engine.launch(step, unit, buffer, Lent(out=buffer), carry=carry)
                continue
            # a mixed bucket gathers each unit into a buffer of the hook's, which it hands to
            # the engine, adding the residual as it copies where the engine allows
            spans = plan.spans[i]
            flat = _flat(buffer, spans, plan.flats[i])
            plan.flats[i] = None  # the engine's until commit
            e = self.engine.addend(step, unit, flat, carry=carry is not None)
            gather_spans(buffer, spans, flat, e)
            given = Given(packed=e is not None, place=(buffer, spans))
            self.engine.launch(step, unit, flat, given, carry=carry)
        if bucket.is_last():
            self._close(step, done)
        return _aggregated(done, buffer, plan, slice(first, first + len(units)), laid=True)

    def _hook_chunks(
        self,
        step: Step,
        done: Future[Outcome],
        bucket: dist.GradBucket,
        plan: _BucketPlan,
        units: list[Unit],
    ) -> Future[Tensor]:
        """:meth:`hook` in two levels (see the class docstring): each unit's gradients (the
        residual pieces carried in, in this rank's share of the node's sum) reduce-scattered
        inside the node, the chunks launched as they arrive, in order."""
        buffer = bucket.buffer()
        first = len(step.wholes)
        hierarchy = self.engine.hierarchy
        assert hierarchy is not None  # formed: two levels
        for i, unit in enumerate(units):
            # a new flat tensor in parameter order, padded to the node's chunks (stage 1 sends
            # it as it is): the buffer's gradients stay as they are
            n = spans_numel(plan.spans[i])
            flat = buffer.new_empty(hierarchy.topology.padded(n))
            flat[n:].zero_()
            gather_spans(buffer, plan.spans[i], flat[:n])
            carry = self._orphans_of(plan, buffer) if unit.compressed else None
            self.engine.scatter(step, unit, flat, carry)
        if bucket.is_last():
            self._close(step, done)
        return _aggregated(done, buffer, plan, slice(first, first + len(units)), laid=False)

    def _sparse(self, bucket: dist.GradBucket) -> Future[Tensor]:
        """Average a sparse gradient as sparse rows: DDP gives a parameter whose gradient is
        sparse (``nn.Embedding(sparse=True)``) a bucket of its own, which holds that gradient.
        It travels uncompressed, outside the engine (no error feedback, not in the step's
        records or wire bytes), as DDP's own all-reduce sends it
        (:meth:`gravac.comm.Communicator.sparse_mean_async`), and is waited for here, on the
        thread that runs the hook (:mod:`gravac.comm`); the engine's step, if one is open,
        still ends at DDP's last bucket."""
        self.engine.join_group()
        averaged: Future[Tensor] = Future()
        averaged.set_result(self.engine.comm.sparse_mean_async(bucket.buffer()).wait())
        if bucket.is_last() and self._step is not None:
            assert self._done is not None
            self._close(self._step, self._done)
        return averaged

    def _close(self, step: Step, done: Future[Outcome]) -> None:
        """End the step at DDP's last bucket: agree its scalars, wait for everything to arrive
        and commit it, on the thread that runs the hook (never in a callback on the process
        group's threads: :mod:`gravac.comm`), then complete every bucket's future.

        Raises:
            gravac.CollectiveError: a collective failed (:class:`gravac.StepTimeoutError`: it
                did not complete within the step timeout); every bucket's future fails with it.
        """
        self._step, self._done = None, None
        try:
            self.engine.close(step).wait()
            outcome = self.engine.commit(step)
            self._bind()  # every bucket seen: the layout is whole before the step finishes
            self.engine.finish(outcome)
        except Exception as exc:  # every bucket's future fails with it
            done.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as T
            raise
        done.set_result(outcome)

    def _plan(self, params: list[Tensor], buffer: Tensor) -> _BucketPlan:
        """The units of a bucket of ``params`` (made once per bucket composition)."""
        ids = tuple(id(p) for p in params)
        plan = self._plans.get(ids)
        if plan is not None:
            return plan
        numels = [p.numel() for p in params]
        total = sum(numels)
        if total != buffer.numel():
            raise RuntimeError(
                f"DDP bucket of {buffer.numel()} elements holds parameters of {total}: gravac's "
                "hook needs a dense bucket laid out in parameter order"
            )
        for p in params:
            position = self._position.setdefault(id(p), len(self._position))
            piece = self._loaded.pop(position, None)
            if piece is not None:
                self._orphans[id(p)] = piece.reshape(-1).to(buffer.dtype)
        compressed = [p.dim() > 1 for p in params]
        for p, c in zip(params, compressed, strict=True):
            if c:
                self._shapes[self._position[id(p)]] = p.shape
        if self.engine.hierarchy is not None:
            return self._chunked_plan(ids, params)
        comp = tuple(p for p, c in zip(params, compressed, strict=True) if c)
        dense = tuple(p for p, c in zip(params, compressed, strict=True) if not c)
        unit_c = None
        if comp:
            layers = tuple(self._position[id(p)] for p in comp)
            unit_c = Unit(self._key_for(comp), tuple(p.shape for p in comp), True, layers=layers)
        unit_d = Unit(-1, tuple(p.shape for p in dense), False) if dense else None
        spans: tuple[Spans, ...] = ()
        if comp and dense:
            spans = (spans_of(numels, compressed, True), spans_of(numels, compressed, False))
        plan = _BucketPlan(unit_c, unit_d, spans, comp)
        self._plans[ids] = plan
        return plan

    def _chunked_plan(self, ids: tuple[int, ...], params: list[Tensor]) -> _BucketPlan:
        """:meth:`_plan` in two levels: each unit's tensors gathered in parameter position
        order, whatever DDP's order in the bucket, so that the chunks a unit is cut into hold
        the same elements in the buckets DDP starts with and in those it rebuilds (a chunk's
        Top-k depends on what the chunk holds)."""
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        order = sorted(range(len(params)), key=lambda i: self._position[id(params[i])])
        kinds = [[i for i in order if (params[i].dim() > 1) == c] for c in (True, False)]
        comp, dense = (tuple(params[i] for i in k) for k in kinds)
        unit_c = None
        if comp:
            layers = tuple(self._position[id(p)] for p in comp)
            unit_c = Unit(self._key_for(comp), tuple(p.shape for p in comp), True, layers=layers)
        unit_d = Unit(-1, tuple(p.shape for p in dense), False) if dense else None
        spans = tuple(tuple((offsets[i], offsets[i + 1]) for i in k) for k in kinds if k)
        plan = _BucketPlan(unit_c, unit_d, spans, comp)
        self._plans[ids] = plan
        return plan

    def _bind(self) -> None:
        """Bind the engine to the compressed shapes seen so far (all of them from the second
        step on: DDP hands every bucket over in each step), when they changed."""
        shapes = tuple(self._shapes[k] for k in sorted(self._shapes))
        hierarchy = self.engine.hierarchy
        if hierarchy is not None:  # the engine sends each compressed unit's chunk
            numels = [sum(p.numel() for p in ps) for _, ps in sorted(self._units.items())]
            shapes = tuple(torch.Size((hierarchy.topology.chunk(n),)) for n in numels)
        if shapes != self._bound:
            self.engine.bind_shapes(shapes)
            self._bound = shapes

    def _key_for(self, params: tuple[Tensor, ...]) -> int:
        """A new key for a unit of ``params``; units that share a parameter with it (DDP's
        first buckets, after its rebuild) are retired first."""
        ids = {id(p) for p in params}
        for key, old in list(self._units.items()):
            if ids & {id(p) for p in old}:
                self._retire(key, old)
        key, self._next_key = self._next_key, self._next_key + 1
        self._units[key] = params
        return key

    def _retire(self, key: int, params: tuple[Tensor, ...]) -> None:
        """Move a unit's residual into per-parameter pieces (added to the next unit that
        holds each parameter) and forget the unit."""
        e = self._residual(key, params)
        if e is not None:
            for p, part in split_flat(e, params):
                piece = part.reshape(-1)
                kept = self._orphans.get(id(p))
                self._orphans[id(p)] = piece.clone() if kept is None else kept + piece
        self.engine.forget(key)
        del self._units[key]
        self._plans = {
            ids: plan
            for ids, plan in self._plans.items()
            if plan.compressed is None or plan.compressed.key != key
        }

    def _residual(self, key: int, params: tuple[Tensor, ...]) -> Tensor | None:
        """Unit ``key``'s residual as its parameters' flat gradient: the residual itself, or in
        two levels this rank's chunk of it as its share of the node's sum
        (:meth:`gravac.hierarchy.Hierarchy.spread`: the pieces are added to this rank's
        gradients before the node's reduce-scatter)."""
        e = self.engine.memory.residual(key)
        hierarchy = self.engine.hierarchy
        if e is None or hierarchy is None:
            return e
        return hierarchy.spread(e, sum(p.numel() for p in params))

    def _orphans_of(self, plan: _BucketPlan, like: Tensor) -> Tensor | None:
        """The residual pieces of retired units for the compressed unit's parameters, laid out
        as its flat gradient, in ``like``'s dtype and device (``None``: none)."""
        if not self._orphans or not any(id(p) in self._orphans for p in plan.params):
            return None
        pieces = [
            self._orphans.pop(id(p), torch.zeros(p.numel(), dtype=like.dtype, device=like.device))
            for p in plan.params
        ]
        return torch.cat(pieces).to(like.dtype)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The engine's state, with the residuals by parameter position (DDP's buckets are
        made anew, and rebuilt, in the run that loads it)."""
        pieces: dict[int, Tensor] = {k: v.clone() for k, v in self._loaded.items()}
        for key, params in self._units.items():
            e = self._residual(key, params)
            if e is not None:
                for p, part in split_flat(e, params):
                    pieces[self._position[id(p)]] = part.reshape(-1).clone()
        for p_id, piece in self._orphans.items():
            pieces[self._position[p_id]] = piece.clone()
        shapes = {k: list(v) for k, v in self._shapes.items()}
        return {**self.engine.state_dict(with_memory=False), "residuals": pieces, "shapes": shapes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, before this run's first step (DGC's
        momenta restart; residuals are restored exactly).

        Raises:
            ValueError: the state was saved with another compressor or controller, or lacks
                what it needs, or holds a non-finite residual (named).
        """
        missing = [k for k in ("residuals", "shapes") if k not in state]
        if missing:
            raise ValueError(f"not a GravacHookState state: missing {missing}")
        check_tables("hook state", {"residuals": state["residuals"]})
        # the saved CFs are those the saved shapes deliver: bind them first
        shapes = self._shapes
        self._shapes = {int(k): torch.Size(v) for k, v in state["shapes"].items()}
        self._bind()
        try:
            self.engine.check_state(state, with_memory=False)
        except ValueError:
            self._shapes = shapes
            self._bind()
            raise
        self.engine.load_state_dict(state, with_memory=False)
        self.engine.memory.reset()
        self._loaded = {int(k): torch.as_tensor(v).clone() for k, v in state["residuals"].items()}
        self._units, self._plans, self._orphans, self._position = {}, {}, {}, {}
        self._next_key = 0
        self._checked = False  # the next step checks that every rank loaded the same step

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.config.options(local=False), "state": self.state_dict()}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        """Rebuild on the default process group (as ``PowerSGDState`` does) and load."""
        self.__init__(None, **saved["options"])  # type: ignore[misc]
        self.load_state_dict(saved["state"])

    def close(self) -> None:
        """Flush and close the monitor (rank 0)."""
        self.engine.close_monitor()

    def __repr__(self) -> str:
        e = self.engine
        return (
            f"GravacHookState(compressor={e.compressor!r}, policy={e.policy!r}, "
            f"world_size={e.comm.world_size})"
        )


def _aggregated(
    done: Future[Outcome], buffer: Tensor, plan: _BucketPlan, units: slice, *, laid: bool
) -> Future[Tensor]:
    """The future of a bucket's aggregate, once ``done`` (the step's outcome, whose ``units``
    are the bucket's): NaN where the step was skipped; a bucket of one unit (no spans) its
    aggregate as it is. A bucket with spans had its gradients copied out at launch and returns
    its own buffer, each unit's aggregate in its spans: laid there by the engine (``laid``, as
    PyTorch's all-reduce hook returns its buffer reduced in place), which handed back a flat
    buffer for the next gather; or (two levels) written there from the gathered aggregate."""

    def result(f: Future[Outcome]) -> Tensor:
        outcome = f.value()
        if outcome.skipped:
            return buffer.fill_(math.nan)
        grads = outcome.grads[units]
        if not plan.spans:
            return grads[0].to(buffer.dtype).view_as(buffer)
        for i, (spans, g) in enumerate(zip(plan.spans, grads, strict=True)):
            if laid:
                plan.flats[i] = g
            else:
                scatter_spans(buffer, spans, g.to(buffer.dtype))
        return buffer

    return done.then(result)


def _flat(buffer: Tensor, spans: Spans, out: Tensor | None) -> Tensor:
    """A flat tensor for the buffer's ``spans``: ``out`` (reused across steps), or a new one
    when it is ``None`` or does not fit."""
    n = spans_numel(spans)
    if out is None or out.numel() != n or out.dtype != buffer.dtype or out.device != buffer.device:
        out = torch.empty(n, dtype=buffer.dtype, device=buffer.device)
    return out


def gravac_hook(state: GravacHookState, bucket: dist.GradBucket) -> Future[Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, gravac_hook)``.

    Compresses the bucket with the state's engine and returns a future of the aggregated
    bucket (divided by the world size, as DDP expects).
    """
    return state.hook(bucket)
