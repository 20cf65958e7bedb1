"""What ``gravac compare --scoreboard`` trains, and training it: its setups and their studies.

A setup is a workload on a link, written ``WORKLOAD@LINK`` (:func:`parse_setups`): ``LINK`` is
``loopback`` or a rate as ``tc`` writes it (``1gbit``, ``100mbit``; shaped links need root, as
``--bandwidth`` does). :func:`plan` turns the setups, the static ladder and the searches into
the studies of :mod:`gravac_lab.compare.study`, each a ``gravac compare`` of its own; per
workload, in the order of the setups, in this order:

==============  ====================================  ==========================  ============
role            what                                  where, steps                seeds
==============  ====================================  ==========================  ============
``dense``       DDP                                   loopback, ``steps``         every one
``ladder``      every static CF (Top-k, ``fixed``)    loopback, twice ``steps``   every one
``twins``       every static CF, other batches        loopback, twice ``steps``   one a study
                (``--twins`` only; the ladder's
                study then one a seed too)
``timing``      DDP and every static CF               each shaped link of the     one a study
                                                      workload, ``timing_steps``
``searches``    every search                          each shaped link of the     one a study
                                                      workload, twice ``steps``
==============  ====================================  ==========================  ============

(twice: :data:`gravac_lab.compare.scoreboard.BUDGET_FACTOR`), so that a run cut short leaves
its finished workloads complete.

A search and the static CFs it is judged against train seed by seed, so that they are timed
minutes apart rather than a workload's whole ladder apart: on a shared machine whose pace moves
between hours, the board at ``d3dd25e`` timed vgg-digits' search on loopback at 1.4x its
yardstick's step in a later slot, and at 1.0-1.1x interleaved (``docs/results/scoreboard.md``).
On loopback the searches train in the ladder's study (:data:`INTERLEAVED`), each seed's after
its static CFs; :func:`run_plan` stores its runs as two entries, ``ladder`` and ``searches``,
as if they had trained apart. On a shaped link each seed's timing run comes just before its
searches (a ``timing`` and a ``searches`` study a seed). With the twins, which are judged
against the ladder's runs on the same seed, the ladder's study is one a seed as well, each
followed by its seed's twins.

Dense DDP's and a static CF's metric per step do not depend on the link (they decide nothing
from the clock), only their step times do: they train once per seed on loopback and are timed
on each link by a short run (:mod:`gravac_lab.compare.scoreboard` reads their time to the bar
off both). The searches read the link, so they train on each. :func:`run_plan` runs the studies
and returns what :func:`gravac_lab.compare.scoreboard.score` reads.

With the baselines (``Inputs.baselines``, ``--baselines``) the dense studies and the timing
runs also train DDP with PyTorch's fp16 hook (it decides nothing from the clock either), and
every setup's searches Accordion as the GraVAC paper ran it
(:data:`gravac_lab.compare.scoreboard.ACCORDION`), whose step time follows its regimes.

A ladder's or a search's run stops once it holds the bar (``--stop-at`` set to the bar that
the workload's dense study gives, :data:`gravac_lab.compare.scoreboard.HOLD` evaluations in a
row), as a user who trains to a quality would: its time to the bar is the same, and the steps
after it would cost time and tell the scoreboard nothing. A CF that never reaches the bar
still trains its whole budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gravac_lab.compare import workloads
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.netns import parse_rate
from gravac_lab.compare.runner import run_compare
from gravac_lab.compare.scoreboard import (
    ACCORDION,
    BUDGET_FACTOR,
    DENSE,
    FP16,
    HOLD,
    TWIN_BATCHES,
    TWINS,
    dense_bar,
    static_label,
)
from gravac_lab.compare.study import Study, Variant, parse_variant

__all__ = [
    "DEFAULT_SEARCHES",
    "DEFAULT_SETUPS",
    "DEFAULT_TIMING_STEPS",
    "INTERLEAVED",
    "LOOPBACK",
    "SEEDS",
    "Inputs",
    "PlannedStudy",
    "Setup",
    "ladder_variants",
    "parse_ladder",
    "parse_setups",
    "plan",
    "run_plan",
    "settings",
]

#: the role of the ladder's study on loopback with the loopback setup's searches interleaved
#: seed by seed (module docstring); stored as a ``ladder`` and a ``searches`` entry
INTERLEAVED = "ladder+searches"
#: the roles whose runs stop once they hold the bar (the timing runs are timed, not judged)
_STOPPED = ("ladder", TWINS, "searches", INTERLEAVED)
#: the link of a setup on loopback
LOOPBACK = "loopback"
#: issue 34's setups: the three workloads at 1 Gbit/s and 100 Mbit/s, and the CNN on loopback
DEFAULT_SETUPS = (
    "vgg-digits@1gbit",
    "vgg-digits@100mbit",
    "resnet-digits@1gbit",
    "resnet-digits@100mbit",
    "lstm-text@1gbit",
    "lstm-text@100mbit",
    "vgg-digits@loopback",
)
#: the searches scored unless ``--variant`` names others: the default (``search="auto"``), the
#: search by trial and the paper's Algorithm 1
DEFAULT_SEARCHES = (
    "default=topk:exponential",
    'trial=topk:exponential{"search": "trial"}',
    'paper=topk:exponential{"search": "paper"}',
)
#: the seeds unless ``--seeds`` names others
SEEDS = (0, 1, 2)
#: steps of a timing run on a shaped link: past the timing warm-up, enough for a median step
DEFAULT_TIMING_STEPS = 30
#: the setups' syntax, for messages and ``--help``
_SETUP_SYNTAX = f"WORKLOAD@LINK, LINK {LOOPBACK} or a tc rate (1gbit, 100mbit)"


@dataclass(frozen=True)
class Setup:
    """A workload on a link (``link`` ``None``: loopback)."""

    workload: str
    link: str | None

    @property
    def name(self) -> str:
        """``WORKLOAD@LINK``."""
        return f"{self.workload}@{self.link or LOOPBACK}"


def _setup(text: str) -> Setup:
    workload, at, link = text.strip().partition("@")
    if not at or workload not in workloads.names():
        raise ValueError(
            f"--setups: {text!r} is not {_SETUP_SYNTAX}, WORKLOAD one of {workloads.names()}"
        )
    if link == LOOPBACK:
        return Setup(workload, None)
    try:
        parse_rate(link)
    except ValueError as exc:
        raise ValueError(f"--setups: {text!r}: {exc}; LINK is {LOOPBACK} or a tc rate") from None
    return Setup(workload, link)


def parse_setups(text: str) -> tuple[Setup, ...]:
    """A ``--setups`` value: distinct comma-separated ``WORKLOAD@LINK``.

    Raises:
        ValueError: the message names ``--setups``, the value and what is allowed.
    """
    setups = tuple(_setup(part) for part in text.split(","))
    names = [s.name for s in setups]
    if len(set(names)) != len(names):
        raise ValueError(f"--setups names a setup more than once: {text!r}")
    return setups


def parse_ladder(text: str) -> tuple[float, ...]:
    """A ``--ladder`` value: distinct comma-separated static CFs (``10,100``), each one Top-k
    takes.

    Raises:
        ValueError: the message names ``--ladder``, the value and what is allowed.
    """
    try:
        cfs = tuple(float(p) for p in text.split(","))
    except ValueError:
        cfs = ()
    if not cfs or len(set(cfs)) != len(cfs):
        raise ValueError(f"--ladder must be distinct comma-separated CFs like 10,100, got {text!r}")
    for cf in cfs:
        try:
            ladder_variants((cf,))
        except ValueError as exc:
            raise ValueError(f"--ladder {text!r}: CF {cf:g}: {exc}") from None
    return cfs


def ladder_variants(cfs: Sequence[float]) -> tuple[Variant, ...]:
    """Top-k at each static CF of ``cfs``, labelled ``cf<CF>``."""
    return tuple(parse_variant(f'{static_label(cf)}=topk:fixed{{"cf": {cf:g}}}') for cf in cfs)


@dataclass(frozen=True)
class PlannedStudy:
    """One study of the scoreboard: its role (see the module docstring), workload, link
    (``None``: loopback), the study itself, and in an :data:`INTERLEAVED` study the labels of
    its static CFs (the others are the searches)."""

    role: str
    workload: str
    link: str | None
    study: Study
    ladder: tuple[str, ...] = ()


def _part(summary: Mapping[str, Any], ladder: set[str], of_ladder: bool) -> dict[str, Any]:
    """The summary of an :data:`INTERLEAVED` study kept to its static CFs' runs
    (``of_ladder``) or to its searches' (the rest): its runs, aggregates and variants;
    what the study shares (its configuration, network, host, seconds) as it is."""

    def kept(label: str) -> bool:
        return (label in ladder) is of_ladder

    study = summary["study"]
    return {
        **summary,
        "study": {**study, "variants": [v for v in study["variants"] if kept(v["label"])]},
        "runs": [r for r in summary["runs"] if kept(r["variant"])],
        "aggregates": [a for a in summary["aggregates"] if kept(a["variant"])],
    }


@dataclass(frozen=True)
class Inputs:
    """What a scoreboard runs: ``base`` holds what its studies share (its ``steps`` is dense's
    step budget; workload, modes, link and steps are each study's), the setups, the static
    ladder's CFs, the searches, the seeds, the timing runs' steps, and whether the baselines
    and the ladder's twins train too (the module docstring)."""

    base: CompareConfig
    setups: Sequence[Setup]
    ladder: Sequence[float]
    searches: Sequence[Variant]
    seeds: Sequence[int]
    timing_steps: int
    baselines: bool = False
    twins: bool = False


def plan(inputs: Inputs) -> list[PlannedStudy]:
    """Every study, in the order they run (module docstring).

    Raises:
        ValueError: the message names the option (``--timing-steps``, ``--variant``, or an
            option :class:`Study` checks).
    """
    base, setups, searches, timing_steps = (
        inputs.base,
        inputs.setups,
        inputs.searches,
        inputs.timing_steps,
    )
    if timing_steps <= base.timing_warmup:
        raise ValueError(
            f"--timing-steps ({timing_steps}) must exceed --timing-warmup ({base.timing_warmup})"
        )
    statics = ladder_variants(inputs.ladder)
    accordion = (parse_variant(ACCORDION),) if inputs.baselines else ()
    taken = {DENSE, FP16, *(v.label for v in (*statics, *accordion))}
    for v in searches:
        if v.label in taken:
            raise ValueError(
                f"--variant label {v.label!r} is taken by the ladder, dense DDP or a baseline "
                f"({sorted(taken)}); label the search otherwise, as LABEL=..."
            )
    longer = base.steps * BUDGET_FACTOR
    seeds = tuple(inputs.seeds)

    def config(
        workload: str, link: str | None, modes: tuple[str, ...], steps: int, eval_every: int
    ) -> CompareConfig:
        return replace(
            base,
            workload=workload,
            modes=modes,
            steps=steps,
            eval_every=eval_every,
            bandwidth=link,
            delay=None if link is None else base.delay,
        )

    every = base.eval_every
    dense_modes = (DENSE, FP16) if inputs.baselines else (DENSE,)
    timed_modes = (*dense_modes, "gravac")  # the dense modes and the static CFs
    out: list[PlannedStudy] = []
    for workload in dict.fromkeys(s.workload for s in setups):
        dense = config(workload, None, dense_modes, base.steps, every)
        ladder_cfg = config(workload, None, ("gravac",), longer, every)
        out.append(PlannedStudy("dense", workload, None, Study(dense, (), seeds)))
        twins_cfg = replace(ladder_cfg, batches=TWIN_BATCHES)
        # with the twins, a study a seed: each seed's twins right after its static CFs
        for some in [(seed,) for seed in seeds] if inputs.twins else [seeds]:
            if Setup(workload, None) in setups:
                interleaved = Study(ladder_cfg, (*statics, *searches, *accordion), some)
                labels = tuple(v.label for v in statics)
                out.append(PlannedStudy(INTERLEAVED, workload, None, interleaved, labels))
            else:
                ladder = Study(ladder_cfg, statics, some)
                out.append(PlannedStudy("ladder", workload, None, ladder))
            if inputs.twins:
                out.append(PlannedStudy(TWINS, workload, None, Study(twins_cfg, statics, some)))
        for s in setups:
            if s.workload != workload or s.link is None:
                continue
            # one evaluation, at the end: only a timing run's step times are read
            timed = config(workload, s.link, timed_modes, timing_steps, timing_steps)
            searching = config(workload, s.link, ("gravac",), longer, every)
            for seed in seeds:
                out.append(PlannedStudy("timing", workload, s.link, Study(timed, statics, (seed,))))
                study = Study(searching, (*searches, *accordion), (seed,))
                out.append(PlannedStudy("searches", workload, s.link, study))
    return out


def settings(inputs: Inputs) -> dict[str, Any]:
    """What the scoreboard ran with, for its JSON and its table's header."""
    base, seeds = inputs.base, inputs.seeds
    return {
        "setups": [{"name": s.name, "workload": s.workload, "link": s.link} for s in inputs.setups],
        "ladder": list(inputs.ladder),
        "searches": [v.spec for v in inputs.searches],
        "seeds": list(seeds),
        "steps": base.steps,
        "compressed_steps": base.steps * BUDGET_FACTOR,
        "timing_steps": inputs.timing_steps,
        "hold": HOLD,
        "eval_every": base.eval_every,
        "workers": base.workers,
        "nodes": base.nodes,
        "batch_size": base.batch_size,
        "lr_milestones": list(base.lr_milestones),
        "lr_gamma": base.lr_gamma,
        "baselines": inputs.baselines,
        "twins": inputs.twins,
        "interleaved": True,
    }


def run_plan(
    planned: Sequence[PlannedStudy],
    on_study: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every planned study (:func:`gravac_lab.compare.runner.run_compare`); the study
    entries ``{"role", "workload", "link", "summary"}``. ``on_study`` is called with the
    entries so far after each study (to store them as they come).

    Raises:
        gravac_lab.compare.runner.CompareError: a job failed.
        gravac_lab.compare.netns.NetworkError: shaped links could not be made or removed.
    """
    entries: list[dict[str, Any]] = []
    bars: dict[str, float] = {}  # by workload, from its dense study
    for p in planned:
        study = p.study
        if p.role in _STOPPED and p.workload in bars:
            study = replace(study, config=replace(study.config, stop_at=bars[p.workload]))
        summary = run_compare(study)
        if p.role == "dense":
            bars[p.workload] = dense_bar(summary["runs"], p.workload)
        if p.role == INTERLEAVED:
            statics = set(p.ladder)
            parts = [(r, _part(summary, statics, r == "ladder")) for r in ("ladder", "searches")]
        else:
            parts = [(p.role, summary)]
        for role, part in parts:
            entries.append({"role": role, "workload": p.workload, "link": p.link, "summary": part})
        if on_study is not None:
            on_study(entries)
    return entries
