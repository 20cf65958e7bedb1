"""The engine: the state and the pipeline of a step (see :mod:`gravac.engine` for the
protocol)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from gravac.comm import Arrival, Communicator, collect
from gravac.compressors.base import (
    Collective,
    Compressor,
    Multilevel,
    Payload,
    Replayable,
    Round,
    payload_tensors,
    wire_bytes,
)
from gravac.compressors.dense import NoneCompressor
from gravac.control.factory import make_controller
from gravac.control.noise import signal_fraction, signal_payload, signal_sample
from gravac.control.norms import IntervalNorms
from gravac.control.options import ControllerConfig
from gravac.control.policies.base import ScalingPolicy
from gravac.control.protocol import Controller, GradientUnits, LayerKeyed
from gravac.control.records import DENSE, Plan, Skipped
from gravac.control.replay import ShadowSums
from gravac.control.window import WindowSums
from gravac.engine import flights
from gravac.engine.checkpoint import (
    check_compatible,
    check_controller_state,
    check_keys,
    check_tables,
    check_times,
    interval_norms,
)
from gravac.engine.finite import all_finite, ends, ends_finite, note_x, step_bound
from gravac.engine.observe import Seen, agreed_gains, observation, step_record
from gravac.engine.records import (
    Flight,
    Given,
    Handover,
    Lent,
    Outcome,
    Piece,
    Step,
    Unit,
    piece_key,
)
from gravac.engine.scalars import Row, Table, terms_size
from gravac.engine.stats import AgreedStats
from gravac.hierarchy import Hierarchy, group_topology
from gravac.memory import Memory, NoMemory, ResidualMemory
from gravac.monitor import Monitor, StepRecord, TensorBoardMonitor
from gravac.spans import spans_numel

__all__ = ["MAX_SKIP_RUN", "Engine"]

#: what sends a piece of a unit planned at CF 1 under a compressor that sends such a tensor as
#: it is (:attr:`Compressor.dense_at_one`): the tensor itself, all-reduced
_DENSE_PIECE = NoneCompressor()
#: a tensor's CF and rank under a plan (:func:`_settings`)
_Setting = tuple[float, int | None]


_SKIP = Outcome(skipped=True)
#: steps skipped in a row (non-finite on some rank) after which a step raises instead: a run of
#: skips this long trains nothing and does not end by itself (a diverged model, a NaN loaded);
#: a loss scaler's first overflows skip a few steps, each halving the scale
MAX_SKIP_RUN = 20
#: a gradient lent, its aggregate into a new tensor
_LENT = Lent()


class Engine:
    """The state and pipeline of a step, shared by the optimizer and the DDP hook.

    Build it with :func:`gravac.config.build_engine`, which validates the arguments.

    Args:
        compressor: compresses each unit at the planned CFs.
        policy: the controller's scaling policy.
        config: the controller's hyperparameters.
        memory: the error-feedback memory (residuals, DGC's momenta), keyed by unit key.
        comm: the process group.
        batch_size: samples per rank per step (``None``: throughput counted in steps).
        nonfinite: ``"skip"`` or ``"raise"`` for a non-finite gradient or aggregate.
        ranks_per_node: the nodes to aggregate in two levels (:mod:`gravac.hierarchy`):
            :class:`gravac.GravacConfig`'s field of that name.
        node_precision: what the two levels' dense stages inside a node send a compressed
            unit in (:data:`gravac.hierarchy.NODE_PRECISIONS`).
        node_stage: how those stages move the gradient (:data:`gravac.hierarchy.NODE_STAGES`).
        monitor: a :class:`Monitor`, a ``SummaryWriter`` or a log directory, opened on rank 0
            once the rank is known; or ``None``.
        clock: seconds, for step times (tests inject a deterministic one).
    """

    def __init__(
        self,
        compressor: Compressor,
        policy: ScalingPolicy,
        config: ControllerConfig,
        memory: Memory,
        comm: Communicator,
        *,
        batch_size: int | None,
        nonfinite: str,
        monitor: Any,
        clock: Callable[[], float],
        ranks_per_node: int | None = None,
        node_precision: str = "fp32",
        node_stage: str = "auto",
    ) -> None:
        # What the engine works with.
        self.compressor = compressor  # compresses every compressed unit
        self.comm = comm  # the process group: every rank, the step's scalars agreed in it
        self.ranks_per_node = ranks_per_node  # the option the topology is planned from
        self.node_precision = node_precision  # what a node's dense stages send (two levels)
        self.node_stage = node_stage  # how they move it: shared memory or collectives
        # the nodes, planned, agreed at the first step
        self.topology = group_topology(self.comm, self.ranks_per_node)
        # the two-level groups once formed (form_nodes); None: flat, or not formed yet
        self.hierarchy: Hierarchy | None = None
        self.peers = comm  # the ranks a unit is aggregated among (two-level: one per node)
        self.memory = memory  # error-feedback residuals, by unit key
        self.policy, self.controller_config = policy, config  # what the controller runs
        self.controller = self._make_controller()  # decides the CFs
        self.batch_size = batch_size  # samples per rank per step, for system throughput
        self.nonfinite = nonfinite  # "skip" or "raise"
        # what a skipped step does to the front end's training, said in the skip's warning
        self.skip_effect = "the wrapped optimizer did not step"
        self.clock = clock  # seconds
        self.monitor: Monitor | None = None  # rank 0's step log (other ranks: None)
        self._monitor_spec = monitor  # what to open as the monitor, until it is opened
        if comm.distributed:
            self._open_monitor()

        # State carried from one step to the next (checkpointed but for the clock's).
        self.last_cf: float | None = None  # CF sent at the previous step (None: not searching)
        self.last_end: float | None = None  # the clock at the end of the previous step
        self.last_seconds = -1.0  # the previous step's seconds, end to end (-1: not timed)
        self.last_comm = -1.0  # the previous step's exposed communication seconds (-1: none)
        # the compressor's statistics agreed over ranks, and those kept to lag a step
        self.stats = AgreedStats(compressor, feedback=not isinstance(memory, NoMemory))
        # what each compressed tensor sent over the controller's current window (sampled)
        self.windows = WindowSums()
        # the shadow residuals and sums of the CFs the controller judges unsent (sampled)
        self.shadows = ShadowSums()
        self.layout_numel = 0  # compressed elements of the bound layout (bind_shapes)
        # each layer's gradients summed over the interval (plans with `norms`: Accordion)
        self.norms = IntervalNorms()

        # Statistics.
        self.steps = 0  # steps taken (skipped ones not counted)
        self.skipped_steps = 0  # steps skipped on every rank
        self.skip_run = 0  # of them, the last ones in a row (up to MAX_SKIP_RUN)
        self.total_wire_bytes = 0  # bytes sent by this rank over all steps taken
        self.total_dense_wire_bytes = 0  # what float32 all-reduces would have sent
        self.last_record: StepRecord | None = None  # the last step taken
        self._alone = 0  # steps this process took, or skipped, as a single worker

    # ------------------------------------------------------------------ the group
    def join_group(self) -> None:
        """Join the default process group if it appeared after construction (the HF Trainer
        creates it inside ``TrainingArguments``); never step as one worker while it exists.
        Opens the monitor on rank 0.

        Raises:
            RuntimeError: the group appeared after this engine had already stepped alone.
        """
        if not self.comm.distributed and dist.is_available() and dist.is_initialized():
            if self._alone:
                raise RuntimeError(
                    f"torch.distributed was initialised after gravac took {self._alone} "
                    "step(s) as a single worker; create the optimizer or hook state (or call "
                    "its first step) after init_process_group"
                )
            self.comm = self.peers = self.comm.joined()
            self.topology = group_topology(self.comm, self.ranks_per_node)
            self.controller = self._make_controller()
        self._open_monitor()

    def form_nodes(self) -> None:
        """Make the two-level groups of :attr:`topology`, once: a collective of every rank,
        which the front end calls after the ranks agreed on the topology
        (:meth:`agreement_parts`), so that no rank waits in a group another did not make."""
        if self.hierarchy is not None or self.topology.ranks_per_node == 1:
            return
        self.hierarchy = Hierarchy(
            self.topology,
            precision=self.node_precision,
            timeout=self.comm.timeout,
            stage=self.node_stage,
        )
        self.peers = self.hierarchy.peers

    def agreement_parts(self) -> dict[str, str]:
        """What every rank must share with rank 0, by name, as text
        (:func:`gravac.agreement.check_agreement`): the compressor, the policy, the controller
        settings, what a non-finite value does, the nodes it aggregates in, and the steps
        taken (ranks that loaded checkpoints of different steps would plan different CFs)."""
        return {
            "the nodes (ranks_per_node, or torchrun's LOCAL_WORLD_SIZE)": str(self.topology),
            "the precision inside a node": f"node_precision={self.node_precision}",
            "the node stage": f"node_stage={self.node_stage}",
            "the compressor": repr(self.compressor),
            "the policy": repr(self.policy),
            "the controller settings": repr(self.controller_config),
            "the non-finite rule": f"nonfinite={self.nonfinite}",
            "the steps taken (the checkpoint loaded)": f"{self.steps} steps",
        }

    def relayer(self, layers: Mapping[int, int]) -> None:
        """The front end's layout changed the tensors' layer ids (``layers``: old id -> new id,
        for the tensors still compressed): every state kept by layer moves with its tensor (the
        window and shadow sums, the interval norms, lagging statistics, a controller's own),
        and that of tensors no longer compressed is dropped."""
        self.windows.relayer(layers)
        self.shadows.relayer(layers)
        self.norms.relayer(layers)
        self.stats.relayer(layers)
        if isinstance(self.controller, LayerKeyed):
            self.controller.relayer(layers)

    def bind_shapes(self, shapes: Sequence[torch.Size]) -> None:
        """The shapes of every compressed tensor, in unit order (the front ends call it when
        the layout is known or changes): the compressor plans its deliverable CFs over them,
        the controller snaps what it holds to those, and the window and the shadows sample
        at the stride the layout's size asks for (:func:`gravac.control.window.budget_stride`)
        from the end of the step under way on (:meth:`finish`)."""
        self.compressor.bind_shapes(shapes)
        self.controller.resnap()
        self.layout_numel = sum(math.prod(s) for s in shapes)

    def _fit_samples(self) -> None:
        """Sample at the bound layout's stride from the next step on, called as a step ends
        (no sample is in flight then): the DDP hook binds its layout bucket by bucket during
        its first step and the optimizer before it, so both change strides, if at all, after
        the first step, and decide alike; a checkpoint holds the stride its sums have."""
        self.windows.fit(self.layout_numel)
        self.shadows.fit(self.layout_numel)

    def _make_controller(self) -> Controller:
        """A controller that plans only CFs this compressor delivers at this world size."""
        world, c = self.topology.nodes, self.compressor
        return make_controller(
            self.policy,
            self.controller_config,
            world,
            lambda cf: c.deliverable_cf(cf, world),
            replayable=isinstance(c, Replayable) and type(self.memory) is ResidualMemory,
            ranked=c.takes_ranks,
            sender=f"{c.name!r} with {type(self.memory).__name__}",
        )

    def _open_monitor(self) -> None:
        """Open the monitor on rank 0, once."""
        spec, self._monitor_spec = self._monitor_spec, None
        if spec is None or self.comm.rank != 0:
            return
        if hasattr(spec, "log"):
            self.monitor = cast(Monitor, spec)
            return
        try:
            self.monitor = TensorBoardMonitor(spec)
        except OSError as exc:
            raise ValueError(
                f"monitor={spec!r}: no TensorBoard log can be written there: {exc}"
            ) from None

    def close_monitor(self) -> None:
        """Flush and close the monitor (rank 0)."""
        if self.monitor is not None:
            self.monitor.close()

    def _log(self, record: StepRecord) -> None:
        """Log ``record`` to the monitor (rank 0). A monitor that fails (its directory removed,
        a full disk) is closed and dropped with a warning, and training goes on: it is rank
        0's alone, and an error there would end rank 0's step and not the others'."""
        if self.monitor is None:
            return
        try:
            self.monitor.log(record)
        except Exception as exc:
            monitor, self.monitor = self.monitor, None
            with contextlib.suppress(Exception):
                monitor.close()
            warnings.warn(
                f"gravac's monitor failed at step {record.step} ({type(exc).__name__}: {exc}): "
                "it is closed, and training goes on without it",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ per step
    def begin(self, lr: float | None = None) -> Step:
        """Start a step: the plan and the decision, from values agreed at earlier steps.

        Args:
            lr: the wrapped optimizer's learning rate (Accordion reacts to its decays).
        """
        plan = self.controller.plan()
        snapshot = copy.deepcopy(self.compressor.state_dict())
        terms = torch.zeros(terms_size(len(plan.shadows)), dtype=torch.float64)
        send = DENSE if not plan.per_layer and self._dense_at(plan.send.cf) else plan.send
        if self.hierarchy is not None:
            self.hierarchy.begin_step()
        return Step(self.steps, plan, send, snapshot, terms=terms, lr=lr)

    def _dense_at(self, cf: float) -> bool:
        """Whether a tensor planned at ``cf`` is sent as it is, through the all-reduce: at CF 1
        for a compressor whose payload would be larger (:attr:`Compressor.dense_at_one`)."""
        return cf == DENSE.cf and self.compressor.dense_at_one

    def launch(
        self,
        step: Step,
        unit: Unit,
        flat: Tensor,
        handover: Handover = _LENT,
        *,
        carry: Tensor | None = None,
        complete: bool = True,
    ) -> Future[Tensor]:
        """Compensate, compress and start aggregating one unit's flat gradient ``flat``.

        Args:
            handover: how the front end hands ``flat`` over: :class:`Lent` (read only, the
                aggregate into its ``out``) or :class:`Given` (the engine's until commit).
            carry: residual pieces carried over from units that no longer exist (the DDP
                hook's, after a bucket rebuild or a resume), added to a compressed unit's
                gradient before compensation; per-layer statistics see the gradient alone.
            complete: every tensor of the unit has a gradient on this rank, so none can be
                absent on every rank (the residual update is then settled before the send,
                :meth:`Memory.settle`); ``False``: a missing one is zeros in ``flat``.

        Returns:
            A future that :meth:`commit` completes with the unit's aggregate (the mean over
            ranks of what was sent; with :attr:`Given.place`, see there), or with NaN where
            the step is skipped.
        """
        given = handover if isinstance(handover, Given) else None
        out = handover.out if isinstance(handover, Lent) else flat  # Given: into flat itself
        place = None if given is None else given.place
        if place is not None and spans_numel(place[1]) != unit.numel:
            raise ValueError(
                f"Engine.launch(Given(place=...)) needs spans of the unit's {unit.numel} "
                f"elements, got {place[1]}"
            )
        packed = given is not None and given.packed
        if packed and not self._packable(step, unit, complete, carry is not None):
            raise ValueError(
                "Engine.launch(Given(packed=True)) needs a unit that addend() returned a tensor "
                "for (complete, no carry)"
            )
        t0 = self.clock()
        if not unit.compressed:  # no local check: the all-reduced sum, checked at commit, is
            # non-finite on every rank where an element is on one (NaN and Inf propagate)
            x = flat if out is flat else flat.clone()  # all-reduced in place
            flight = Flight(unit, x, None, self.peers.all_reduce_async(x), _nbytes(x), out)
        else:
            flight = self._launch_compressed(
                step, unit, flat, out, carry, settle=complete, given=given
            )
            flight.spare = given.spare if given is not None else None
        flight.place = place
        step.flights.append(flight)
        step.compress_seconds += self.clock() - t0
        return flight.result

    def chunk_unit(self, unit: Unit) -> Unit:
        """What the engine sends of ``unit`` in two levels (:mod:`gravac.hierarchy`): this
        rank's chunk of it, one flat tensor under the unit's key (its layer id made of the key:
        a chunk is no tensor of the model); ``unit`` itself when flat."""
        if self.topology.ranks_per_node == 1:
            return unit
        size = torch.Size((self.topology.chunk(unit.numel),))
        return Unit(unit.key, (size,), unit.compressed)

    def scatter(self, step: Step, unit: Unit, flat: Tensor, carry: Tensor | None = None) -> None:
        """In two levels, the front end's :meth:`launch` of ``unit``'s gradient ``flat``: its
        node sum reduce-scattered inside the node (started now, in launch order on every rank)
        and this rank's chunk launched once it has arrived (:meth:`launch_scattered`), while
        backward goes on. ``carry``: residual pieces carried in (this rank's share of the
        node's sum, :meth:`gravac.hierarchy.Hierarchy.spread`), reduce-scattered on their own:
        one rank's nonzero a position, divided back exactly, they reach the chunk's owner as
        the residual itself, bit for bit. ``flat`` must not change until the step's commit."""
        hierarchy = self.hierarchy
        assert hierarchy is not None  # formed: two levels
        carried = None if carry is None else hierarchy.scatter(carry, step=step.index)
        summed = hierarchy.scatter(flat, lossy=unit.compressed, step=step.index)
        step.scattering.append((self.chunk_unit(unit), summed, carried))
        step.wholes.append(unit.numel)
        self.launch_scattered(step, wait=False)

    def launch_scattered(self, step: Step, *, wait: bool) -> None:
        """Launch the chunks whose node sums have arrived (:meth:`scatter`), in launch order;
        with ``wait``, all of them."""
        while step.scattering and (wait or step.scattering[0][1].ready()):
            unit, summed, carried = step.scattering.pop(0)
            carry = None if carried is None else carried.wait()
            self.launch(step, unit, summed.wait(), Given(), carry=carry)

    def needs_spare(self, step: Step, unit: Unit) -> bool:
        """Whether :meth:`launch` with :class:`Given` would put ``unit``'s aggregate into a new
        tensor at commit: it sends a compressed payload under error feedback but has no residual
        yet whose storage the aggregate would take (see :attr:`Given.spare`)."""
        return (
            unit.compressed
            and step.decision.which != "dense"
            and not isinstance(self.memory, NoMemory)
            and self.memory.residual(unit.key) is None
        )

    def addend(
        self, step: Step, unit: Unit, flat: Tensor, *, complete: bool = True, carry: bool = False
    ) -> Tensor | None:
        """What a front end that gives ``flat`` over (:meth:`launch` with :class:`Given`) may add
        to the gradients as it writes them into ``flat``, so that it holds ``x = g + e`` without
        a pass of its own (:meth:`Memory.addend`); it then launches with ``Given(packed=True)``.

        ``None``: it writes the gradients alone and :meth:`launch` compensates them. That is
        the case for a dense unit, one with a missing gradient (``complete=False``) or residual
        pieces to ``carry`` in, per-layer CFs, a plan that sums the gradient alone
        (:attr:`gravac.control.records.Plan.norms`), a memory that keeps more than a residual, and
        the first step.
        """
        if not self._packable(step, unit, complete, carry):
            return None
        return self.memory.addend(unit.key, flat)

    def _packable(self, step: Step, unit: Unit, complete: bool, carry: bool) -> bool:
        """Whether :meth:`launch` may take ``unit`` packed (see :meth:`addend`)."""
        if not unit.compressed or not complete or carry or step.plan.norms:
            return False
        return len(set(_settings(step.plan, unit))) == 1

    def _launch_compressed(
        self,
        step: Step,
        unit: Unit,
        flat: Tensor,
        out: Tensor | None,
        carry: Tensor | None,
        *,
        settle: bool,
        given: Given | None,
    ) -> Flight:
        """Launch a compressed unit in four stages: ``x = g + e``; compress it at the plan's
        CFs, with the gain terms of each; the window's and shadows' terms; send what the
        decision names, the residual settled now where nothing reads ``x`` later."""
        plan = step.plan
        if plan.norms:
            self.norms.add(unit.layer_ids, flat, unit.numels)
        # every tensor has a gradient here: nothing reads x after the send (the residual update
        # is settled now, or a dense send zeroes it), so the window's sample is taken first
        early = settle and carry is None
        settings = _settings(plan, unit)
        per_layer = len(set(settings)) > 1
        x, in_flat = self._compensate(unit, flat, carry, given, in_place=early and not per_layer)
        if per_layer:
            return self._launch_layers(step, unit, x, settings, out)
        chosen, as_is, terms = self._compress(step, unit, x, settings[0])
        e = self._search_terms(step, unit, x, carry, terms)
        taken = self.windows.taken(x, unit.numels) if early and self._sums(plan) else None
        shadow = self.shadows.gradient(x, e, unit.numels) if plan.shadows else None
        if as_is:
            total = x if early else x.clone()  # all-reduced in place
            reduced = self.peers.all_reduce_async(total)
            flight = Flight(unit, x, None, reduced, _nbytes(total), out, taken=taken)
            flight.shadow = shadow
            return flight
        payload, ctx = chosen
        residual = None
        if early and not _aliases(payload, x):
            residual = self.memory.settle(unit.key, x, self.compressor, payload, ctx)
        window_send = None
        if taken is not None and residual is not None:  # what was sent is known: held instead
            window_send = self.windows.sampled_send(taken, residual, unit.numels)
            taken = None
        gathered = self._send(payload, read_later=residual is None)
        if in_flat and residual is None:  # x, in flat, is read at commit: the aggregate goes
            out = None  # into a new tensor
        return Flight(
            unit,
            x,
            chosen,
            gathered,
            wire_bytes(payload),
            out,
            residual=residual,
            taken=taken,
            window_send=window_send,
            shadow=shadow,
            rotate=in_flat and residual is not None,
        )

    def _compensate(
        self, unit: Unit, flat: Tensor, carry: Tensor | None, given: Given | None, *, in_place: bool
    ) -> tuple[Tensor, bool]:
        """``x = g + e`` (``g``: ``flat``, plus the residual pieces ``carry``d in) and whether
        it is in ``flat``'s storage: as the front end packed it there (:attr:`Given.packed`),
        formed there where ``flat`` is given and ``in_place`` allows, else a tensor of its own."""
        if given is not None and given.packed:
            return flat, True
        if given is not None and in_place:
            x = self.memory.compensate_(unit.key, flat)
            if x is not None:
                return x, True
        return self.memory.compensate(unit.key, flat if carry is None else flat + carry), False

    def _compress(
        self, step: Step, unit: Unit, x: Tensor, setting: _Setting
    ) -> tuple[tuple[Payload, Any], bool, list[Tensor]]:
        """Compress ``x`` at the plan's ``theta_min`` (``setting``) and candidate CFs (the
        candidate from the first payload where the compressor is multi-level), with the gain
        terms ``<c, x>, ||c||^2`` of each and ``||x||^2`` (zeros where not measured). Returns
        the payload the decision sends, whether ``x`` goes as it is instead (dense, or CF 1
        with a compressor that then sends ``x``), and the terms."""
        c, plan = self.compressor, step.plan
        cf_min, rank = setting
        ranks = None if rank is None else (rank,) * len(unit.shapes)
        base = Round(step.index, unit.key, self.peers.world_size, layout=unit.shapes, ranks=ranks)
        # at CF 1 a compressor that sends such a tensor as it is has x itself as its payload
        c_min = _DENSE_PIECE if self._dense_at(cf_min) else c
        multilevel = c if isinstance(c, Multilevel) and c_min is c else None
        cfs = [cf_min] if c_min is c else []
        if plan.candidate is not None and multilevel is None:
            cfs.append(plan.candidate)
        rounds = self.stats.rounds(step, x, cfs, base, unit.layer_ids, self.peers)
        r_min, r_c = (rounds[0], rounds[1:]) if c_min is c else (base, rounds)
        p_min, ctx_min = c_min.compress(x, cf_min, r_min)
        chosen = (p_min, ctx_min)
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        terms = [*c_min.sent_terms(x, p_min, ctx_min)] if plan.measure else [zero, zero]
        if plan.candidate is not None:
            if multilevel is None:
                p_c, ctx_c = c.compress(x, plan.candidate, r_c[0])
            else:
                p_c, ctx_c = multilevel.recompress(p_min, ctx_min, plan.candidate, r_min)
            terms += [*c.sent_terms(x, p_c, ctx_c)]
            if step.decision.which == "candidate":
                chosen = (p_c, ctx_c)
        else:
            terms += [zero, zero]
        checked = c.sends_input or self.stats.shows_nonfinite
        terms.append(note_x(step, x, measure=plan.measure, checked=checked))
        which = step.decision.which
        as_is = which == "dense" or (c_min is not c and which == "min")
        return chosen, as_is, terms

    def _search_terms(
        self, step: Step, unit: Unit, x: Tensor, carry: Tensor | None, terms: list[Tensor]
    ) -> Tensor | None:
        """Add the unit's gain ``terms`` to the step's, with, at a window's close, the window's
        terms and each shadow CF's (:mod:`gravac.control.window`, :mod:`gravac.control.replay`);
        return the residual ``x`` holds (the previous step's, the pieces ``carry``d in added)
        where the window or the shadows read it, else ``None``."""
        plan = step.plan
        windowed = plan.window_terms and self._windowed
        e = None
        if windowed or plan.shadows:
            e = self.memory.residual(unit.key)
            if carry is not None:
                e = carry if e is None else e + carry
        if windowed:
            totals: list[Tensor] | None = [] if plan.signal else None
            window = self.windows.terms(unit.layer_ids, unit.numels, e, totals).to(x.device)
            step.totals += [signal_sample(t) for t in totals or ()]  # held until close()
            shadows = self.shadows.terms(plan.shadows, unit.layer_ids, unit.numels)
        else:
            window = torch.zeros(3, dtype=torch.float64, device=x.device)
            shadows = torch.zeros(3 * len(plan.shadows), dtype=torch.float64)
        local = [torch.stack(terms), window, shadows.to(x.device)]
        step.terms = step.terms.to(x.device) + torch.cat(local)
        return e

    def _send(
        self, payload: Payload, *, read_later: bool = True, collective: Collective | None = None
    ) -> Arrival[Any]:
        """Start the compressor's collective (or ``collective``) of ``payload``; an all-reduce
        sums into the payload itself unless the residual update still reads it at commit
        (``read_later``, under error feedback)."""
        in_place = not read_later or isinstance(self.memory, NoMemory)
        how = self.compressor.collective if collective is None else collective
        return self.peers.send_payload(payload, how, in_place=in_place)

    def _sums(self, plan: Plan) -> bool:
        """Whether what a unit sends this step is added to the window's sums (not at the step
        that closes a window, which starts the next one; not with per-layer CFs)."""
        return self._windowed and not plan.window_terms and not plan.per_layer

    def _launch_layers(
        self, step: Step, unit: Unit, x: Tensor, settings: Sequence[_Setting], out: Tensor | None
    ) -> Flight:
        """Send a unit whose tensors have CFs (or ranks) of their own (per-layer decisions):
        each run of adjacent tensors at one setting is a piece, a view of ``x`` compressed and
        sent on its own. No gains are measured (a per-layer policy reads none)."""
        world = self.peers.world_size
        step.ends.append(ends(x))
        pieces = []
        for first, last, start, end in _runs(unit.shapes, settings):
            key = piece_key(unit.key, first)
            cf, rank = settings[first]
            ranks = None if rank is None else (rank,) * (last - first)
            base = Round(step.index, key, world, layout=unit.shapes[first:last], ranks=ranks)
            piece, c = x[start:end], self.compressor
            if self._dense_at(cf):  # sent as it is (the residual of its span: zero)
                rnd, c = base, _DENSE_PIECE
            else:
                layers = unit.layer_ids[first:last]
                (rnd,) = self.stats.rounds(step, piece, [cf], base, layers, self.peers)
            payload, ctx = c.compress(piece, cf, rnd)
            arrived = self._send(payload, collective=c.collective)
            pieces.append(Piece(start, end, payload, ctx, arrived, c))
        arrived = collect([p.arrived for p in pieces])
        nbytes = sum(wire_bytes(p.payload) for p in pieces)
        return Flight(unit, x, None, arrived, nbytes, out, pieces=tuple(pieces))

    @property
    def _windowed(self) -> bool:
        """Whether window gains are measured: under error feedback (without it, what a step
        does not send is lost, and the per-step gain is the window's)."""
        return not isinstance(self.memory, NoMemory)

    def close(
        self,
        step: Step,
        has_grad: Sequence[bool] = (),
        stale: bool = False,
        layout: int = 0,
        sparse: int = -1,
        dropped: bool = False,
    ) -> Arrival[Any]:
        """Start agreeing the step's scalars (after the last :meth:`launch`) and, while they
        and the units travel, replay the plan's shadow CFs (:meth:`_replay`); the arrival's
        ``wait()`` returns once they and every unit's aggregate have arrived, or raises
        :class:`gravac.comm.CollectiveError` (:class:`gravac.comm.StepTimeoutError` past the
        step timeout) naming the step and the first collective that did not complete.

        Args:
            step: the step, every unit launched.
            has_grad: per tensor, whether this rank has its gradient (:attr:`Unit.slots`).
            stale: this rank changed a gradient after it was launched; :meth:`commit` then
                raises on every rank (a change the aggregate does not hold would be lost).
            layout: the front end's layout digest (:func:`~gravac.engine.scalars.layout_check`)
                of the parameters it trains, or will train from the next step on; :meth:`commit`
                raises on every rank where ranks differ in it, or in the step's index.
            sparse: the index of the first parameter this rank has a sparse gradient for
                (-1: none), launched as zeros; :meth:`commit` then raises
                :class:`SparseGradientError` on every rank.
            dropped: the front end discards the step's gradients; :meth:`commit` drops the
                step where every rank does (:meth:`_drop`), and raises on every rank where
                only some do.
        """
        self.launch_scattered(step, wait=True)
        step.flags = len(has_grad)
        values = torch.tensor(self._local_values(step), dtype=torch.float64)
        step.values = len(values)
        row = Row(
            nonfinite=not ends_finite(step.ends),
            stale=stale,
            interval=self.last_seconds,
            exposed=self.last_comm,
            bound=step_bound(step),
            step=step.index,
            layout=layout,
            sparse=sparse,
            dropped=dropped,
            has_grad=has_grad,
            terms=step.terms,
            values=values,
            stats=[s for _, s in step.stats],
        )
        step.scalars = self.comm.all_gather_async(row.pack(self.comm.device))
        waits: list[Arrival[Any]] = [
            step.scalars.named("the step's scalars"),
            *(f.arrived.named(_carries(f)) for f in step.flights),
        ]
        if step.totals:
            payload = signal_payload(step.totals)
            if self.hierarchy is not None:
                payload = self.hierarchy.signal_slot(payload)
            payload = payload.to(self.comm.device)
            step.signal = self.comm.all_reduce_async(payload)
            waits.append(step.signal.named("the window's signal sample"))
        self._replay(step)
        step.closed_at = self.clock()  # what the step waits from here on is communication
        return collect(waits, step.index)

    def _local_values(self, step: Step) -> list[float]:
        """What this rank adds to the step's scalars for the controller: with a plan's
        ``norms``, its learning rate (NaN: unknown) and, at an interval's last step, each
        layer's norm of its summed gradients."""
        plan = step.plan
        if not plan.norms:
            return []
        lr = math.nan if step.lr is None else float(step.lr)
        return [lr, *(self.norms.local_norms() if plan.norms_due else [])]

    def commit(self, step: Step) -> Outcome:
        """Apply a step whose :meth:`close` future has completed, in five stages: check the
        agreed scalars, aggregate every unit, feed the residuals back, let the controller
        observe the agreed values, record the step; or skip it on every rank.

        Raises:
            FloatingPointError: ``nonfinite="raise"`` and some value was not finite.
            RuntimeError: some rank changed a gradient after it was launched.
            RuntimeError: some ranks dropped the step, others did not.
            ValueError: the ranks are at different steps, or train different parameters.
            SparseGradientError: some rank had a sparse gradient.
        """
        table, comm_seconds = self._check(step)
        if table.all_dropped:
            return self._drop(step)
        if table.any_nonfinite:
            return self._skip(step)
        totals = self._aggregate_all(step, table.bound)
        if totals is None:
            return self._skip(step)
        self.last_comm = comm_seconds  # agreed with the next step's scalars
        present = table.present
        self._feed_back(step, present)
        seen = self._observe(step, table)
        record = step_record(step, seen, comm_seconds, self.skipped_steps)
        for f, g in zip(step.flights, totals, strict=True):
            f.result.set_result(g)
        self.skip_run = 0
        whole = self._whole(step, totals)
        self._end(timed=True)
        return Outcome(False, whole, present, record, search=seen.search)

    def _end(self, *, timed: bool) -> None:
        """Stamp the end of a step: the next step is timed from here, and this one's seconds
        since the end of the step before (``timed``: a step committed after one that ended) go
        with the next step's scalars; a skipped step is not timed."""
        now = self.clock()
        if timed and self.last_end is not None:
            self.last_seconds = now - self.last_end
        else:
            self.last_seconds = -1.0
        self.last_end = now

    def _whole(self, step: Step, totals: list[Tensor]) -> tuple[Tensor, ...]:
        """Each unit's aggregate: ``totals``, or in two levels every unit's chunks all-gathered
        inside the node (in launch order, on every rank); what a 16-bit gather rounded off
        this rank's chunk is added to the chunk's residual, where it has one, to be sent again
        (the same on each of the chunk's peers: their mean sends it once)."""
        if self.hierarchy is None:
            return tuple(totals)
        out = []
        for f, g, n in zip(step.flights, totals, step.wholes, strict=True):
            whole, rounded_off = self.hierarchy.gather(
                g, n, lossy=f.unit.compressed, step=step.index
            )
            if rounded_off is not None and (e := self.memory.residual(f.unit.key)) is not None:
                e.view(-1).add_(rounded_off)
            out.append(whole)
        return tuple(out)

    def _check(self, step: Step) -> tuple[Table, float]:
        """Stage 1: every rank's scalars and the seconds the step waited for them since its
        close; raise on every rank if the ranks are at different steps, train different
        parameters, some rank had a sparse gradient, or changed a gradient after it was
        launched."""
        if step.scalars is None or step.closed_at is None:
            raise RuntimeError("Engine.commit() needs a step closed by Engine.close()")
        rows = torch.stack(step.scalars.value()).cpu()
        comm_seconds = self.clock() - step.closed_at
        terms = terms_size(len(step.plan.shadows))
        table = Table(rows, flags=step.flags, terms=terms, values=step.values)
        self._fail_if(step, table.disagreement(step.index))  # no local: see _fail_if
        return table, comm_seconds

    def _fail_if(self, step: Step, error: Exception | None) -> None:
        """Fail ``step`` on every rank with ``error`` (``None``: go on), before it changed
        anything: the compressor's state is as it was before the step, every unit's result
        fails.

        The results fail with a copy of ``error`` that holds no traceback: a torch future
        holding the raised error would keep the failed step's frames, and with them the front
        end and its buffers, alive for good (Python's collector cannot see through the C++
        future), and a dropped optimizer's gradient hooks would go on firing; nor may a frame
        the traceback holds keep ``error`` in a local (a cycle)."""
        if error is None:
            return
        self.compressor.load_state_dict(step.snapshot)
        for f in step.flights:
            f.result.set_exception(_untraced(error))  # type: ignore[arg-type]  # stub: T
        try:
            raise error
        finally:
            del error  # the traceback holds this frame: no cycle through it

    def _aggregate_all(self, step: Step, bound: float) -> list[Tensor] | None:
        """Stage 2: every unit's aggregate (laid into its place, where it has one); ``None``
        where one is not finite. The aggregates the compressor does not vouch for, given the
        agreed ``bound`` on every rank's ``max |x|``, are computed and checked first, into
        buffers a skip may overwrite."""
        c, world = self.compressor, self.peers.world_size
        vouched = [flights.vouched(f, bound, c, world) for f in step.flights]
        checked = {
            i: flights.aggregate(f, None if f.rotate else f.out, c, world)
            for i, (f, v) in enumerate(zip(step.flights, vouched, strict=True))
            if not v
        }
        if not all_finite(list(checked.values())):
            return None
        totals = []
        for i, f in enumerate(step.flights):
            # swaps a rotating flight's residual in, vouched or not
            target = flights.target(f, self.memory)
            if f.place is not None:
                totals.append(flights.lay(f, target, checked.get(i), c, world))
            elif i in checked:
                totals.append(checked[i])
            else:
                totals.append(flights.aggregate(f, target, c, world))
        return totals

    def _feed_back(self, step: Step, present: tuple[bool, ...]) -> None:
        """Stage 3: error feedback: each compressed unit's residual ``e <- x - D(sent)``, the
        plan's shadow CFs' replays (made at :meth:`close`) applied, and the window's sums
        cleared where a window closed."""
        for f in step.flights:
            if f.unit.compressed:
                self._update_residual(f, present, step.plan)
            if f.replayed is not None:
                self.shadows.apply(f.replayed)
        if step.plan.window_terms:
            keep = step.plan.horizon - 1  # windows the next gains span too
            self.windows.clear(keep)
            self.shadows.clear(keep)

    def _observe(self, step: Step, table: Table) -> Seen:
        """Stage 4: the agreed gains, throughput and values shown to the controller (when
        something was compressed: otherwise nothing was searched)."""
        seen = agreed_gains(step, table.summed_terms, self.controller.phase, self._windowed)
        if not seen.compressed:
            return seen
        self.stats.keep(step, table.stats)
        plan = seen.plan  # the step's: something was compressed
        if plan.window_terms and step.signal is not None:
            seen.share = signal_fraction(step.signal.value().cpu(), self.peers.world_size)
        samples = (self.batch_size or 1) * self.comm.world_size
        shown = observation(
            seen, table, last_cf=self.last_cf, samples=samples, norm_layers=self.norms.layers
        )
        seen.report = self.controller.observe(shown)
        if plan.norms_due:
            self.norms.end_interval()
        return seen

    def _update_residual(self, f: Flight, present: tuple[bool, ...], plan: Plan) -> None:
        """``e <- x - D(sent)``, and what was sent (``x - e``) added to the window's sums
        (:meth:`_sums`)"""
        sums, window_send = self._sums(plan), f.window_send
        taken = None  # the window's sample of x, taken before x becomes the residual
        if sums and window_send is None:
            taken = f.taken if f.taken is not None else self.windows.taken(f.x, f.unit.numels)
        flights.update_memory(f, present, self.memory, self.compressor)
        if window_send is not None and sums:  # the residual settled at launch, the send sampled
            self.windows.add_send(f.unit.layer_ids, f.unit.numels, window_send)
        elif taken is not None:
            residual = self.memory.residual(f.unit.key)
            self.windows.add(f.unit.layer_ids, f.unit.numels, taken, residual)

    def _replay(self, step: Step) -> None:
        """Replay error feedback at each of the plan's shadow CFs on every flight's sampled
        gradient (:mod:`gravac.control.replay`), to be applied at commit (:meth:`_feed_back`),
        added to the window's shadow sums as :meth:`_sums` says. :meth:`close` calls it once the
        step's collectives are in flight, so that it runs while they travel."""
        if not step.plan.shadows:
            return
        assert isinstance(self.compressor, Replayable)  # the factory refuses shadows otherwise
        select, accumulate = self.compressor.shadow_kept, self._sums(step.plan)
        for f in step.flights:
            if f.shadow is not None:
                unit = f.unit
                f.replayed = self.shadows.replay(
                    step.plan.shadows,
                    unit.layer_ids,
                    unit.numels,
                    f.shadow,
                    select,
                    accumulate=accumulate,
                )

    def finish(self, outcome: Outcome) -> None:
        """Count and log a committed step (after the wrapped optimizer stepped, for the
        optimizer front end); sample at the bound layout's stride from the next step on."""
        self._fit_samples()
        record = outcome.record
        if outcome.skipped or record is None:
            return
        self.total_wire_bytes += record.wire_bytes
        self.total_dense_wire_bytes += record.dense_wire_bytes
        saved = self.total_dense_wire_bytes - self.total_wire_bytes
        record = dataclasses.replace(record, bytes_saved=saved)
        self.last_record = record
        self._alone += not self.comm.distributed
        self.last_cf = record.cf_sent if outcome.search else None
        self.steps += 1
        self._log(record)

    def _skip(self, step: Step) -> Outcome:
        """Skip the step on every rank: the compressor as before the step, residuals and
        controller untouched (never updated)."""
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite gradient on at least one rank, or non-finite aggregate, at step "
                f"{step.index}"
            )
        self._undo(step)
        report = self.controller.observe(Skipped(step.plan))
        self.skipped_steps += 1
        self._alone += not self.comm.distributed
        self.last_cf, self.last_comm = None, -1.0
        self._end(timed=False)
        if self.skipped_steps & (self.skipped_steps - 1) == 0:  # 1, 2, 4, 8, ...: rate-limited
            warnings.warn(
                f"gravac skipped step {step.index}: a gradient or aggregate was not finite on "
                "some rank, so residuals, compressor and controller were left as they were, "
                f"and {self.skip_effect} ({self.skipped_steps} skipped so far; the next "
                f"warning at {2 * self.skipped_steps})",
                RuntimeWarning,
                stacklevel=4,
            )
        self._log(StepRecord.skip(step.index, report.phase, self.skipped_steps))
        self.skip_run += 1
        if self.skip_run >= MAX_SKIP_RUN:
            self.skip_run = 0  # a caller that goes on gets the next run's bound
            raise FloatingPointError(
                f"gravac skipped {MAX_SKIP_RUN} steps in a row (the last {step.index}): a "
                "gradient or aggregate was not finite on some rank at each, so nothing trained. "
                "Likely causes: a diverged model or loss (lower the learning rate, check the "
                "data and the loss), a non-finite residual or parameter loaded from a "
                "checkpoint, or a loss scale that never recovers"
            )
        return _SKIP

    def _drop(self, step: Step) -> Outcome:
        """Drop a step every rank's front end discarded (:meth:`close`'s ``dropped``): as if
        its launches had not been, the compressor, residuals and window sums as before it, the
        controller not told, the next step timed from here and with the times of the step
        before it (the dropped step's scalars carried them, and went unread). Its
        per-layer interval sums (Accordion's) cannot be taken back: the interval restarts, as
        at a skip, and the controller is told so."""
        self._undo(step)
        self.last_end = self.clock()
        if step.plan.norms:
            self.controller.observe(Skipped(step.plan))
        return _SKIP

    def _undo(self, step: Step) -> None:
        """What a skipped or dropped step's launches did, undone: the compressor's state as
        before it, the interval's per-layer sums restarted; every unit's result NaN (as the DDP
        hook gives a skipped step)."""
        self.compressor.load_state_dict(step.snapshot)
        if step.plan.norms:
            self.norms.restart()
        for f in step.flights:
            nan = f.out if f.out is not None else torch.empty_like(f.x.reshape(-1))
            f.result.set_result(nan.fill_(math.nan))

    def rescale(self, factor: float) -> None:
        """The gradients' unit changed between steps (a loss scale that
        :class:`gravac.amp.GradScaler` changed by ``factor``): multiply what is kept in it by
        ``factor`` (the residuals and DGC's momenta, the window's and the shadows' sampled
        sums, the interval's per-layer sums and the norms Accordion compares them with, the
        lagging compressor statistics).
        For a power of two (a ``GradScaler``'s growth and backoff) every product is exact:
        training goes on bit for bit as if the gradients had always been in the new unit.
        Between steps only, on every rank alike.

        Raises:
            ValueError: ``factor`` is not a finite number above 0.
        """
        if not (isinstance(factor, float | int) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number above 0, got {factor!r}")
        self.memory.rescale(factor)
        self.windows.rescale(factor)
        self.shadows.rescale(factor)
        self.norms.rescale(factor)
        self.stats.rescale(factor)
        if isinstance(self.controller, GradientUnits):
            self.controller.rescale(factor)

    def forget(self, key: int) -> None:
        """Drop everything kept for unit ``key`` (its residual, the compressor's state and
        buffers), a unit that no longer exists (DDP's bucket rebuild); in two levels also the
        window and shadow sums of its chunk, whose layer id is made of ``key`` (a flat unit's
        tensors keep theirs: their ids outlive the rebuild)."""
        self.memory.reset(key)
        self.compressor.forget(key)
        if self.hierarchy is not None:
            chunk = (piece_key(key, 0),)  # its one tensor's id (:meth:`chunk_unit`)
            self.windows.forget(chunk)
            self.shadows.forget(chunk)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self, *, with_memory: bool = True) -> dict[str, Any]:
        """Counters, residuals (unless ``with_memory`` is false: a front end that saves them
        its own way), controller and compressor state."""
        memory = {"memory": self.memory.state_dict()} if with_memory else {}
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "total_wire_bytes": self.total_wire_bytes,
            "total_dense_wire_bytes": self.total_dense_wire_bytes,
            "last_cf": self.last_cf,
            "last_seconds": self.last_seconds,
            "last_comm": self.last_comm,
            "lagged_stats": self.stats.state_dict(),
            "window_sums": self.windows.state_dict(),
            "shadow_sums": self.shadows.state_dict(),
            "interval_norms": self.norms.state_dict(),
            **memory,
            "compressor": self.compressor.state_dict(),
            "controller": self.controller.state_dict(),
            # What the state above is only valid with (checked by check_state).
            "controller_kind": type(self.controller).__name__,
            "compressor_config": repr(self.compressor),
            "world_size": self.comm.world_size,
            "ranks_per_node": self.topology.ranks_per_node,
        }

    def check_state(
        self,
        state: dict[str, Any],
        *,
        with_memory: bool = True,
        units: Mapping[int, tuple[int, torch.dtype]] | None = None,
    ) -> None:
        """Check a saved state before loading it: every key it needs; the same compressor
        (name and options); a controller of the same kind (the searches by trial and by shadow
        take each other's: the shadow's is the trial's and its shadows) whose state loads;
        finite residuals (of ``units``' sizes and dtypes, by key, where given) and step
        times; a different world size loads with a warning.

        Raises:
            ValueError: naming what is wrong.
        """
        check_keys(state, with_memory=with_memory)
        check_times(state)
        check_compatible(
            state,
            topology=self.topology,
            compressor=repr(self.compressor),
            controller_kind=type(self.controller).__name__,
            policy=repr(self.policy),
        )
        if with_memory:
            check_tables("memory", state["memory"], units)
        check_controller_state(self._make_controller(), state["controller"])
        world = state.get("world_size")
        if world is not None and world != self.comm.world_size:
            warnings.warn(
                f"loading a checkpoint saved with world size {world} into world size "
                f"{self.comm.world_size}: each rank's residuals are its own, so they now stand "
                "for other ranks' unsent gradients (a one-off perturbation)",
                stacklevel=4,
            )

    def load_state_dict(self, state: dict[str, Any], *, with_memory: bool = True) -> None:
        """Restore what :meth:`state_dict` returned (the caller validates and rolls back)."""
        self.controller.load_state_dict(state["controller"])
        self.compressor.load_state_dict(state["compressor"])
        if with_memory:
            self.memory.load_state_dict(state["memory"])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.total_wire_bytes = int(state["total_wire_bytes"])
        self.total_dense_wire_bytes = int(state["total_dense_wire_bytes"])
        self.last_cf = state["last_cf"]
        # the step before the checkpoint's times, agreed with the resumed first step's scalars
        self.last_seconds = float(state.get("last_seconds", -1.0))
        self.last_comm = float(state.get("last_comm", -1.0))
        self.last_end = None  # the resumed first step is not timed
        self.stats.load_state_dict(state.get("lagged_stats", []))
        self.windows.load_state_dict(state.get("window_sums", {"sent": []}))
        self.shadows.load_state_dict(state.get("shadow_sums", {}))
        self.norms.load_state_dict(interval_norms(state))


def _untraced(error: Exception) -> Exception:
    """A copy of ``error`` (same type, arguments and attributes) without its traceback."""
    twin = type(error).__new__(type(error))
    twin.args = error.args
    twin.__dict__.update(error.__dict__)
    return twin


def _carries(f: Flight) -> str:
    """What a flight's collective carries, in words, for errors."""
    what = "gradient" if f.dense else "payload"
    n = len(f.unit.shapes)
    return f"unit {f.unit.key}'s {what} ({n} tensor{'s' * (n != 1)}, {f.unit.numel} elements)"


def _aliases(payload: Payload, x: Tensor) -> bool:
    """Whether a tensor of ``payload`` shares ``x``'s storage (``none`` sends ``x`` itself),
    so that updating the residual in ``x`` before the send would change what is sent."""
    ptr = x.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in payload_tensors(payload))


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _settings(plan: Plan, unit: Unit) -> tuple[_Setting, ...]:
    """Each of ``unit``'s tensors' CF and rank (``None``: the CF decides) under ``plan``."""
    cfs = plan.cfs_for(unit.layer_ids)
    ranks = plan.ranks_for(unit.layer_ids)
    return tuple(zip(cfs, ranks or (None,) * len(cfs), strict=True))


def _runs(
    shapes: Sequence[torch.Size], settings: Sequence[_Setting]
) -> list[tuple[int, int, int, int]]:
    """The runs of adjacent tensors at one setting (CF and rank): ``(first, last)`` tensor
    indices (``last`` excluded) and the ``(start, end)`` elements they span."""
    runs: list[tuple[int, int, int, int]] = []
    offset = 0
    for i, (shape, setting) in enumerate(zip(shapes, settings, strict=True)):
        end = offset + math.prod(shape)
        if runs and settings[runs[-1][0]] == setting:
            first, _, start, _ = runs[-1]
            runs[-1] = (first, i + 1, start, end)
        else:
            runs.append((i, i + 1, offset, end))
        offset = end
    return runs
