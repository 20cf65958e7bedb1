"""The scoreboard's judgement: the quality bar, time to it, the yardstick and each search's ratio.

Plain functions over the stored results of a scoreboard (``gravac compare --scoreboard``,
:mod:`gravac_lab.compare.scoreboard_plan`): what it trained is a list of study entries, each
``{"role", "workload", "link", "summary"}`` with ``summary`` as
:func:`gravac_lab.compare.runner.run_compare` returns it. Roles: ``dense`` (DDP, the step budget,
loopback), ``ladder`` (the static CFs, twice the budget, loopback), ``timing`` (DDP and the
static CFs, a short run on a shaped link) and ``searches`` (the searches, twice the budget, on
the setup's link); on a shaped link a ``timing`` and a ``searches`` entry a seed, where the
scoreboard interleaved them seed by seed. The definitions (issue 34):

* **The bar**, per workload: dense DDP's final metric at the step budget (the median over the
  seeds), less :data:`ACCURACY_POINT` of accuracy, or plus :data:`PERPLEXITY_SHARE` of
  perplexity (a metric where lower is better).
* **Time to the bar**: the training seconds until the first evaluation at the bar that the next
  :data:`HOLD` - 1 evaluations also meet (the run's last evaluation alone does not count: nothing
  confirms it). A run trains dense's budget (dense) or :data:`BUDGET_FACTOR` times it (the
  others); one that never holds the bar has no time. Dense DDP and a static CF decide nothing
  from the clock, so their metric per step does not depend on the link: on a shaped link their
  time is their own clock on loopback plus, for each step up to that evaluation, their median
  step time in a short run on that link (``timing``, on the same seed where each seed was
  timed) less their median step on loopback (:func:`link_clock`); on loopback, and for every
  search, it is the run's own clock.
* **The yardstick**, per setup: the fastest static CF of the ladder (the lowest median time to
  the bar) among those that reach the bar on every seed; a static CF that misses it on any seed
  does not count, however fast. ``None`` when none reaches it on every seed.
* **A ratio**, per search and setup: on each seed, the search's time to the bar over the
  yardstick's on the same seed (``inf`` where the search never reached the bar); reported as the
  median over the seeds and their range. A search meets the bar only if it reached it on every
  seed.

Bytes are reported, not judged: the MB a rank sent until the bar was reached.

**The twins** (``--twins``): how far a run's time to the bar moves by luck alone. Every static CF
trains a second time on loopback, each rank drawing another order of batches
(:data:`TWIN_BATCHES`) from the same shard, from the same initial weights: the same recipe, the
same expected quality, another trajectory; timed on a link as its CF is. A search's run is such
another trajectory too, so a twin's time over its CF's (:func:`twin_ratios`) is what a search as
good as that CF scores by luck alone, and the yardstick's twin is what a search that *is* the
yardstick would score. :func:`chance` turns the ratios of every CF's twin into the chance that the
median over the seeds of such a search's ratios meets :data:`TARGET_RATIO`.

With the baselines (``--baselines``; issue 35) the dense study also trains DDP with PyTorch's
fp16 hook (:data:`FP16`, timed on each link as DDP is) and the searches' study Accordion as the
GraVAC paper ran it (:data:`ACCORDION`: PowerSGD at rank 4 in critical regimes, 1 otherwise;
its step time changes with its regimes, so it trains on each link). Their rows are of kind
``"baseline"``, and :func:`versus` sets the default search against each of them, seed by seed.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gravac_lab.compare import workloads
from gravac_lab.compare.config import STOP_HOLD

__all__ = [
    "ACCORDION",
    "ACCURACY_POINT",
    "BASELINES",
    "BUDGET_FACTOR",
    "DENSE",
    "FP16",
    "HOLD",
    "LADDER",
    "PERPLEXITY_SHARE",
    "TARGET_RATIO",
    "TWINS",
    "TWIN_BATCHES",
    "TWIN_SUFFIX",
    "Reach",
    "Row",
    "SetupRuns",
    "SetupScore",
    "bar",
    "bar_evaluation",
    "by_label",
    "chance",
    "chance_at_least",
    "dense_bar",
    "link_clock",
    "ratios",
    "reach",
    "score",
    "score_setup",
    "sent_most",
    "setup_runs",
    "spread",
    "static_label",
    "twin_ratios",
    "versus",
    "versus_sent",
    "yardstick",
]

#: issue 34's bound on a search's ratio to the yardstick (the median over the seeds)
TARGET_RATIO = 1.15
#: the role of the twins' study: the static ladder again, other batches (module docstring)
TWINS = "twins"
#: the batch order the twins draw (:attr:`gravac_lab.compare.config.CompareConfig.batches`;
#: 0 is the seed's own)
TWIN_BATCHES = 1
#: a twin's label: its CF's, with this after it
TWIN_SUFFIX = " twin"
#: the bar on accuracy: dense's final accuracy less one point (accuracies are fractions)
ACCURACY_POINT = 0.01
#: the bar on perplexity: dense's final perplexity plus 3% of it
PERPLEXITY_SHARE = 0.03
#: evaluations in a row at the bar that reach it: the first, and the next one confirming it
HOLD = STOP_HOLD
#: compressed runs (static CFs and searches) may train up to this many times dense's budget
BUDGET_FACTOR = 2
#: the static CFs (Top-k) the yardstick is chosen from unless told
LADDER = (10.0, 20.0, 40.0, 100.0, 160.0, 1000.0)
#: bytes in the tables' MB
_MB = 1e6
#: the label of dense DDP's runs and row
DENSE = "ddp"
#: the label of DDP with PyTorch's fp16 compression hook (a baseline: its mode's name)
FP16 = "ddp-fp16"
#: Accordion as the GraVAC paper ran it (PowerSGD, ranks 4 and 1 by regime), a baseline
ACCORDION = "accordion=powersgd:accordion"
#: the labels of the baselines' rows
BASELINES = (FP16, ACCORDION.partition("=")[0])


def bar(final_metrics: Sequence[float], higher_is_better: bool) -> float:
    """The quality bar from dense DDP's final metric on each seed (see the module docstring).

    Raises:
        ValueError: no final metric given.
    """
    if not final_metrics:
        raise ValueError("the bar needs dense DDP's final metric on at least one seed")
    dense = statistics.median(final_metrics)
    return dense - ACCURACY_POINT if higher_is_better else dense * (1 + PERPLEXITY_SHARE)


def dense_bar(runs: Sequence[Mapping[str, Any]], workload: str) -> float:
    """The bar of ``workload`` from dense DDP's stored ``runs`` (one per seed; the runs of
    other modes of its study, the fp16 hook's, are left out)."""
    dense = [r["final_metric"] for r in runs if r["mode"] == DENSE]
    return bar(dense, workloads.get(workload).higher_is_better)


def bar_evaluation(
    metrics: Sequence[float], bar_value: float, higher_is_better: bool, hold: int = HOLD
) -> int | None:
    """The index of the first of ``metrics`` (a run's evaluations, in order) at the bar from
    which ``hold`` evaluations in a row meet it; ``None`` if there is none (fewer than ``hold``
    left at the end do not count)."""
    meets = [m >= bar_value if higher_is_better else m <= bar_value for m in metrics]
    for i in range(len(meets) - hold + 1):
        if all(meets[i : i + hold]):
            return i
    return None


@dataclass(frozen=True)
class Reach:
    """One run against the bar.

    Attributes:
        seed: the run's seed.
        seconds: time to the bar (``None``: not reached).
        step: the step of the evaluation that reached it (``None``: not reached).
        mb: MB a rank sent up to that step (``None``: not reached).
        final_metric: the metric after the run's last step.
    """

    seed: int
    seconds: float | None
    step: int | None
    mb: float | None
    final_metric: float


def reach(run: Mapping[str, Any], bar_value: float, higher_is_better: bool) -> Reach:
    """``run`` (a :class:`gravac_lab.compare.report.ModeSummary` as stored, its evaluations'
    clocks on the setup's link: :func:`setup_runs`) against the bar."""
    evaluations = run["evaluations"]
    i = bar_evaluation([e[2] for e in evaluations], bar_value, higher_is_better)
    if i is None:
        return Reach(run["seed"], None, None, None, run["final_metric"])
    step, seconds = int(evaluations[i][0]), float(evaluations[i][1])
    mb = sum(run["wire_bytes_by_step"][:step]) / _MB
    return Reach(run["seed"], seconds, step, mb, run["final_metric"])


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """The median, lowest and highest of ``values`` (``inf`` sorts last).

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("a spread needs at least one value")
    return statistics.median(values), min(values), max(values)


def _median_seconds(reaches: Sequence[Reach]) -> float:
    return statistics.median(r.seconds for r in reaches if r.seconds is not None)


def yardstick(statics: Mapping[str, Sequence[Reach]]) -> str | None:
    """The label of the fastest static CF (lowest median time to the bar) of those that reached
    the bar on every seed; ``None`` if none did. Ties go to the first in ``statics``' order."""
    counted = {
        label: _median_seconds(reaches)
        for label, reaches in statics.items()
        if reaches and all(r.seconds is not None for r in reaches)
    }
    if not counted:
        return None
    return min(counted, key=lambda label: counted[label])


def ratios(run: Sequence[Reach], yard: Sequence[Reach]) -> list[float]:
    """Per seed of ``run``, its time to the bar over the yardstick's on the same seed (``inf``
    where ``run`` did not reach it).

    Raises:
        ValueError: a seed of ``run`` that the yardstick did not run or did not reach the bar on.
    """
    yard_seconds = {r.seed: r.seconds for r in yard}
    out = []
    for r in run:
        base = yard_seconds.get(r.seed)
        if base is None:
            raise ValueError(f"the yardstick has no time to the bar on seed {r.seed}")
        out.append(math.inf if r.seconds is None else r.seconds / base)
    return out


def versus(run: Sequence[Reach], other: Sequence[Reach]) -> list[float]:
    """Per seed of ``run``, its time to the bar over ``other``'s on the same seed: ``inf``
    where only ``other`` reached the bar, ``0`` where only ``run`` did, ``nan`` where neither
    did or ``other`` did not run the seed."""
    other_seconds = {r.seed: r.seconds for r in other}
    out = []
    for r in run:
        base = other_seconds.get(r.seed)
        if r.seconds is None:
            out.append(math.nan if base is None else math.inf)
        elif base is None:
            out.append(0.0 if r.seed in other_seconds else math.nan)
        else:
            out.append(r.seconds / base)
    return out


def chance(values: Sequence[float], seeds: int, target: float = TARGET_RATIO) -> float:
    """The chance that the median of ``seeds`` ratios drawn independently from ``values`` is at
    most ``target``: with ``p`` the share of ``values`` at most ``target`` (``inf``, a bar not
    reached, is above it; ``nan``, nothing to compare, is left out), the chance that at least
    ``(seeds + 1) / 2`` of the draws are, ``sum_k C(seeds, k) p^k (1 - p)^(seeds - k)``.

    Raises:
        ValueError: ``seeds`` is not a positive odd count (an even count's median is the mean of
            two draws), or no value is a number.
    """
    if seeds < 1 or seeds % 2 == 0:
        raise ValueError(f"seeds must be a positive odd count, got {seeds}")
    counted = [v for v in values if not math.isnan(v)]
    if not counted:
        raise ValueError("the chance needs at least one ratio that is a number")
    p = sum(v <= target for v in counted) / len(counted)
    need = (seeds + 1) // 2
    return sum(math.comb(seeds, k) * p**k * (1 - p) ** (seeds - k) for k in range(need, seeds + 1))


def chance_at_least(values: Sequence[float], seeds: int, ratio: float) -> float:
    """The chance that the median of ``seeds`` ratios drawn independently from ``values`` is at
    least ``ratio``: one less :func:`chance` that it is below it (how often luck alone scores
    a search's median ``ratio`` or worse, where ``values`` are the twins' ratios).

    Raises:
        ValueError: as :func:`chance`.
    """
    return 1.0 - chance(values, seeds, target=math.nextafter(ratio, -math.inf))


def static_label(cf: float) -> str:
    """The label of the ladder's static CF ``cf`` (``cf40``)."""
    return f"cf{cf:g}"


def sent_most(run: Mapping[str, Any]) -> float | None:
    """The CF ``run`` sent at the most steps (``cf_sent_by_step``; of a tie the highest),
    ``None`` where it logged no CF sent (dense steps log none)."""
    counts = collections.Counter(cf for cf in run.get("cf_sent_by_step") or () if cf is not None)
    if not counts:
        return None
    return max(counts, key=lambda cf: (counts[cf], cf))


@dataclass(frozen=True)
class Row:
    """One configuration of a setup over the seeds.

    Attributes:
        label: ``ddp``, a static CF's label, a search's or a baseline's.
        kind: ``"dense"``, ``"static"``, ``"search"`` or ``"baseline"``.
        reaches: each seed's :class:`Reach`, in seed order.
        ratios: each seed's ratio to the yardstick (``None``: no yardstick).
    """

    label: str
    kind: str
    reaches: tuple[Reach, ...]
    ratios: tuple[float, ...] | None

    @property
    def reached(self) -> int:
        """Seeds on which the bar was reached."""
        return sum(r.seconds is not None for r in self.reaches)

    @property
    def reached_every_seed(self) -> bool:
        """Whether the bar was reached on every seed."""
        return self.reached == len(self.reaches)


@dataclass(frozen=True)
class SetupScore:
    """A setup's scoreboard.

    Attributes:
        setup: ``WORKLOAD@LINK``.
        metric: the workload's metric name.
        higher_is_better: the metric's direction.
        bar: the quality bar.
        yardstick: the yardstick's label (``None``: no static CF reached the bar on every seed).
        network: how the searches' link was made (its description).
        rows: dense DDP, then the static CFs, then their twins (where trained, labelled
            with :data:`TWIN_SUFFIX`), then the searches, then the baselines.
        sent: per search, each seed's static CF (its label) that the search sent at the most
            steps (:func:`sent_most`), ``None`` where that CF is not on the ladder.
    """

    setup: str
    metric: str
    higher_is_better: bool
    bar: float
    yardstick: str | None
    network: str
    rows: tuple[Row, ...]
    sent: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict)

    def has(self, label: str) -> bool:
        """Whether a row is labelled ``label``."""
        return any(r.label == label for r in self.rows)

    def row(self, label: str) -> Row:
        """The row labelled ``label``.

        Raises:
            KeyError: no such row.
        """
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(label)


def versus_sent(s: SetupScore, search: str) -> list[float]:
    """Per seed, the search's time to the bar over that of the static CF it sent most on that
    seed (:attr:`SetupScore.sent`), on the same seed (:func:`versus`; ``nan`` where that CF is
    not on the ladder): above 1 where the search ran its CF slower than the CF's static run,
    whatever it chose.

    Raises:
        KeyError: ``search`` is not a search of ``s``.
    """
    out = []
    for r, label in zip(s.row(search).reaches, s.sent[search], strict=True):
        out += [math.nan] if label is None else versus([r], s.row(label).reaches)
    return out


def twin_ratios(s: SetupScore) -> dict[str, list[float]]:
    """Each static CF's twin's time to the bar over the CF's own, seed by seed (:func:`versus`),
    by the CF's label; empty where the twins did not train."""
    cfs = [row.label.removesuffix(TWIN_SUFFIX) for row in s.rows if row.kind == "twin"]
    return {cf: versus(s.row(cf + TWIN_SUFFIX).reaches, s.row(cf).reaches) for cf in cfs}


def _matching(
    studies: Sequence[Mapping[str, Any]], role: str, workload: str, link: str | None
) -> list[Any]:
    """The summaries of the studies of ``role`` for ``workload`` on ``link`` (``dense`` and
    ``ladder`` are on loopback), in the order stored: none, one, or one a seed where the
    scoreboard interleaved a shaped link's timing runs and searches seed by seed."""
    key = (role, workload, link)
    return [s["summary"] for s in studies if (s["role"], s["workload"], s["link"]) == key]


def _has(studies: Sequence[Mapping[str, Any]], role: str, workload: str, link: str | None) -> bool:
    """Whether the stored results hold a study of ``role`` for ``workload`` on ``link``."""
    return bool(_matching(studies, role, workload, link))


def _entries(
    studies: Sequence[Mapping[str, Any]], role: str, workload: str, link: str | None
) -> list[Any]:
    """:func:`_matching`, which must find one at least.

    Raises:
        ValueError: the stored results have no such study.
    """
    found = _matching(studies, role, workload, link)
    if not found:
        where = "loopback" if link is None else link
        raise ValueError(f"the stored results have no {role} study of {workload} on {where}")
    return found


def _runs(
    studies: Sequence[Mapping[str, Any]], role: str, workload: str, link: str | None
) -> list[Mapping[str, Any]]:
    """Every run of the studies of ``role`` for ``workload`` on ``link`` (:func:`_entries`)."""
    return [r for summary in _entries(studies, role, workload, link) for r in summary["runs"]]


def by_label(runs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Runs grouped by label (the variant of a gravac run, the mode of another: ``ddp``,
    ``ddp-fp16``), in order, each by seed."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["variant"] or r["mode"], []).append(r)
    return {label: sorted(group, key=lambda r: int(r["seed"])) for label, group in out.items()}


def _network(summary: Mapping[str, Any]) -> str:
    """How a study's link was made, and why it was not shaped where it was not."""
    network = summary["network"]
    note = network.get("note")
    return str(network["description"]) + (f"; {note}" if note else "")


@dataclass(frozen=True)
class SetupRuns:
    """A setup's stored runs by label, each label's runs in seed order, every evaluation's
    clock the time it stands for on the setup's link: dense DDP's and the static CFs' (trained
    on loopback) their step times that link's timing run (see the module docstring), the
    searches' their own.

    Attributes:
        dense: DDP's runs, and with the baselines DDP with the fp16 hook's, by mode.
        statics: the static CFs' runs, by label.
        searches: the searches' runs (with the baselines, Accordion's too), by label.
        twins: the static CFs' twins' runs (module docstring), by their CF's label; empty
            where they did not train.
        timing: each label's runs in the short timing studies on the link, in seed order
            (empty on loopback): one a seed, or the first seed's alone (scoreboards before
            ``INTERLEAVED`` timed one seed).
        network: how the searches' link was made (its description).
    """

    dense: dict[str, list[Mapping[str, Any]]]
    statics: dict[str, list[Mapping[str, Any]]]
    searches: dict[str, list[Mapping[str, Any]]]
    twins: dict[str, list[Mapping[str, Any]]]
    timing: dict[str, list[Mapping[str, Any]]]
    network: str


def link_clock(run: Mapping[str, Any], step_seconds: float) -> dict[str, Any]:
    """``run`` (trained on loopback) as if on a link whose median step is ``step_seconds``:
    each evaluation's clock ``t + step * (step_seconds - m)``, with ``m`` the run's own median
    step (``run["step_seconds"]``).

    A run's own clock exceeds its steps times its median step by what its first steps cost
    once and by its slower steps (``docs/results/scoreboard.md``, its last section); a search's
    clock on the link holds those too, so a static CF's time on the link keeps them and shifts
    each step by what the link adds.
    """
    shift = step_seconds - float(run["step_seconds"])
    evaluations = [[step, t + step * shift, metric] for step, t, metric in run["evaluations"]]
    return {**run, "evaluations": evaluations}


def setup_runs(studies: Sequence[Mapping[str, Any]], workload: str, link: str | None) -> SetupRuns:
    """The runs of ``workload`` on ``link`` (``None``: loopback) in the stored studies.

    Raises:
        ValueError: a study or a timing run the setup needs is missing.
    """
    timed = {} if link is None else by_label(_runs(studies, "timing", workload, link))

    def step_seconds(label: str, seed: int) -> float:
        """The step of ``label`` on the link: its timing run on ``seed``, else on the first
        seed timed."""
        if label not in timed:
            raise ValueError(f"the stored timing study of {workload} on {link} has no {label}")
        runs = timed[label]
        run = next((r for r in runs if int(r["seed"]) == seed), runs[0])
        return float(run["step_seconds"])

    def on_link(runs: dict[str, list[Mapping[str, Any]]]) -> dict[str, list[Mapping[str, Any]]]:
        if link is None:
            return runs
        return {
            label: [link_clock(r, step_seconds(label, int(r["seed"]))) for r in group]
            for label, group in runs.items()
        }

    twins = (
        by_label(_runs(studies, TWINS, workload, None))
        if _has(studies, TWINS, workload, None)
        else {}
    )
    return SetupRuns(
        dense=on_link(by_label(_runs(studies, "dense", workload, None))),
        statics=on_link(by_label(_runs(studies, "ladder", workload, None))),
        searches=by_label(_runs(studies, "searches", workload, link)),
        twins=on_link(twins),
        timing=timed,
        network=_network(_entries(studies, "searches", workload, link)[0]),
    )


def score_setup(
    studies: Sequence[Mapping[str, Any]], workload: str, link: str | None
) -> SetupScore:
    """The scoreboard of ``workload`` on ``link`` (``None``: loopback) from the stored studies.

    Raises:
        ValueError: a study or a timing run the setup needs is missing.
    """
    w = workloads.get(workload)
    runs = setup_runs(studies, workload, link)
    bar_value = dense_bar(runs.dense[DENSE], workload)

    def reaches(group: Sequence[Mapping[str, Any]]) -> tuple[Reach, ...]:
        return tuple(reach(r, bar_value, w.higher_is_better) for r in group)

    static_reaches = {label: reaches(group) for label, group in runs.statics.items()}
    search_reaches = {label: reaches(group) for label, group in runs.searches.items()}
    baseline_reaches = {
        **{label: reaches(group) for label, group in runs.dense.items() if label != DENSE},
        **{label: search_reaches.pop(label) for label in BASELINES if label in search_reaches},
    }
    yard = yardstick(static_reaches)

    def row(label: str, kind: str, rs: tuple[Reach, ...]) -> Row:
        return Row(
            label, kind, rs, None if yard is None else tuple(ratios(rs, static_reaches[yard]))
        )

    return SetupScore(
        setup=f"{workload}@{link or 'loopback'}",
        metric=w.metric_name,
        higher_is_better=w.higher_is_better,
        bar=bar_value,
        yardstick=yard,
        network=runs.network,
        rows=(
            row(DENSE, "dense", reaches(runs.dense[DENSE])),
            *(row(label, "static", rs) for label, rs in static_reaches.items()),
            *(
                row(label + TWIN_SUFFIX, "twin", reaches(group))
                for label, group in runs.twins.items()
            ),
            *(row(label, "search", rs) for label, rs in search_reaches.items()),
            *(row(label, "baseline", rs) for label, rs in baseline_reaches.items()),
        ),
        sent={
            label: tuple(_ladder_label(sent_most(r), static_reaches) for r in runs.searches[label])
            for label in search_reaches
        },
    )


def _ladder_label(cf: float | None, statics: Mapping[str, Any]) -> str | None:
    """The static CF ``cf``'s label where it is on the ladder (``statics``), else ``None``."""
    label = None if cf is None else static_label(cf)
    return label if label in statics else None


def score(stored: Mapping[str, Any]) -> list[SetupScore]:
    """Every setup of a stored scoreboard (``{"scoreboard": {"setups": [...], "seeds":
    [...]}, "studies": [...]}``), in its order; a setup whose searches are not stored on every
    seed yet (a run cut short: they train last of a setup's studies, or of each seed's) is left
    out.

    Raises:
        ValueError: a setup whose searches are stored lacks another study it needs.
    """
    studies = stored["studies"]
    seeds = set(stored["scoreboard"]["seeds"])
    out = []
    for setup in stored["scoreboard"]["setups"]:
        workload, link = setup["workload"], setup["link"]
        searches = _matching(studies, "searches", workload, link)
        if seeds <= {int(r["seed"]) for summary in searches for r in summary["runs"]}:
            out.append(score_setup(studies, workload, link))
    return out
