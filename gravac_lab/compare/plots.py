"""A study's figures as PNG files: the metric against time and bytes, and the CFs gravac sent.

:func:`write_plots` draws a study's summary (:func:`gravac_lab.compare.runner.run_compare`) into a
directory, one colour a mode and variant and one line a seed:

* ``metric_time.png``: the metric at every evaluation against training seconds (evaluation
  excluded), with the target: time to accuracy;
* ``metric_bytes.png``: the same against the bytes one worker had put into the collectives by
  then (log scale): accuracy per byte;
* ``cf_steps.png``: the CF every step of every gravac run sent at (log scale; 1 is dense);
* ``cf_density.png``: how a variant's steps, over all its seeds, spread over the CFs it sent
  (log scale), as the GraVAC paper shows it: a Gaussian kernel density estimate over
  log10 CF (left), and the fraction of steps in bins of :data:`BINS_PER_DECADE` a decade
  (right).

The CF figures are drawn only when a gravac mode ran. matplotlib (the ``demo`` and ``dev``
extras) is imported only to draw, and used through :class:`matplotlib.figure.Figure`, whose
``savefig`` renders with Agg: no pyplot, no display, no global state.

.. note:: The paper passes a smoothing bandwidth of 0.1 to the Gaussian KDE, where (scipy's
   and pandas' ``bw_method``) it scales the data's standard deviation. Here the bandwidth is
   :data:`KDE_BANDWIDTH` decades of CF, absolute, so that a static CF (no spread at all) has a
   density too, and every variant is smoothed alike.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BINS_PER_DECADE",
    "KDE_BANDWIDTH",
    "PLOT_FILES",
    "check_available",
    "write_plots",
]

#: the files :func:`write_plots` writes, by figure (the CF ones only when gravac ran)
PLOT_FILES = {
    "metric_time": "metric_time.png",
    "metric_bytes": "metric_bytes.png",
    "cf_steps": "cf_steps.png",
    "cf_density": "cf_density.png",
}
#: standard deviation of the density's Gaussian kernel, in decades of CF (the paper's 0.1)
KDE_BANDWIDTH = 0.1
#: the density is drawn this many bandwidths beyond the lowest and highest CF, where it has
#: fallen to e^-8 of a lone CF's peak
_KDE_REACH = 4.0
#: points the density is evaluated at
_KDE_POINTS = 400
#: histogram bins a decade of CF: 10 tells 100 from 126 (the geometric policy's steps) apart
BINS_PER_DECADE = 10
#: inches of one figure, and of the density figure's two panels side by side
_FIGSIZE = (8.0, 5.0)
_WIDE_FIGSIZE = (13.0, 5.0)
#: dots per inch of the PNGs
_DPI = 100
#: opacity of a run's line: seeds of one variant overlap
_ALPHA = 0.8
#: the default colour cycle's length; more modes and variants take the 20-colour map
_CYCLE = 10
#: opacity of the grid lines
_GRID_ALPHA = 0.3
#: bytes in the axis' MB
_MB = 1e6


def check_available() -> None:
    """Raise ``ValueError`` naming ``--plots`` if matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plots needs matplotlib, which is not installed: pip install 'gravac[demo]'"
        )


_Runs = list[dict[str, Any]]


def _groups(runs: _Runs) -> dict[str, _Runs]:
    """_Runs by mode and variant (``gravac cf100``), in the order they ran."""
    groups: dict[str, _Runs] = {}
    for run in runs:
        name = run["mode"] if run["variant"] is None else f"{run['mode']} {run['variant']}"
        groups.setdefault(name, []).append(run)
    return groups


def _colours(names: list[str]) -> dict[str, Any]:
    """A colour a mode and variant, the same in every figure."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= _CYCLE else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _figure(figsize: tuple[float, float] = _FIGSIZE, columns: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=_DPI, layout="constrained")
    return fig, fig.subplots(1, columns)


def _evaluation_times(run: dict[str, Any]) -> tuple[list[float], list[float]]:
    return [t for _, t, _ in run["evaluations"]], [v for _, _, v in run["evaluations"]]


def _evaluation_bytes(run: dict[str, Any]) -> tuple[list[float], list[float]]:
    sent = np.cumsum(run["wire_bytes_by_step"])
    mb = [float(sent[step - 1]) / _MB for step, _, _ in run["evaluations"]]
    return mb, [v for _, _, v in run["evaluations"]]


def _cf_steps(run: dict[str, Any]) -> tuple[range, list[float]]:
    sent = run["cf_sent_by_step"]
    return range(1, len(sent) + 1), [math.nan if cf is None else cf for cf in sent]


def _cf_logs(runs: _Runs) -> np.ndarray:
    """log10 of every CF sent in ``runs`` (steps gravac skipped left out)."""
    return np.log10([cf for run in runs for cf in run["cf_sent_by_step"] if cf is not None])


def _draw_runs(
    ax: Any,
    groups: dict[str, _Runs],
    colours: dict[str, Any],
    xy: Callable[[dict[str, Any]], tuple[Any, Any]],
    **style: Any,
) -> None:
    """One line a run (``xy(run)``: its x and y; ``style``: matplotlib's line options), one
    legend entry a mode and variant."""
    for name, runs in groups.items():
        for i, run in enumerate(runs):
            ax.plot(
                *xy(run), color=colours[name], alpha=_ALPHA, label=name if i == 0 else None, **style
            )


def _finish(ax: Any, xlabel: str, ylabel: str, *, log_x: bool = False) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_x:
        ax.set_xscale("log")
    ax.legend(fontsize="small")
    ax.grid(alpha=_GRID_ALPHA)


def _draw_density(
    kde_ax: Any, hist_ax: Any, groups: dict[str, _Runs], colours: dict[str, Any]
) -> None:
    """The GraVAC paper's CF density (left) and the fraction of steps per CF bin (right)."""
    logs = {name: _cf_logs(runs) for name, runs in groups.items()}
    everything = np.concatenate(list(logs.values()))
    low, high = float(everything.min()), float(everything.max())
    reach = _KDE_REACH * KDE_BANDWIDTH
    grid = np.linspace(low - reach, high + reach, _KDE_POINTS)
    # bins centred on multiples of 1 / BINS_PER_DECADE decades, so that a CF of 10^k is a centre
    centres = np.arange(round(low * BINS_PER_DECADE), round(high * BINS_PER_DECADE) + 2)
    edges = (centres - 0.5) / BINS_PER_DECADE
    norm = 1.0 / (KDE_BANDWIDTH * math.sqrt(2 * math.pi))
    for name, values in logs.items():
        z = (grid[:, None] - values[None, :]) / KDE_BANDWIDTH
        kde_ax.plot(
            10**grid, norm * np.exp(-0.5 * z**2).mean(axis=1), color=colours[name], label=name
        )
        hist_ax.hist(
            10**values,
            bins=10**edges,
            weights=np.full(len(values), 1.0 / len(values)),
            histtype="step",
            color=colours[name],
            label=name,
        )
    _finish(
        kde_ax,
        "CF sent",
        f"density of steps over log10 CF (KDE, {KDE_BANDWIDTH} decades)",
        log_x=True,
    )
    _finish(hist_ax, "CF sent", "fraction of steps", log_x=True)


def write_plots(summary: dict[str, Any], directory: Path) -> list[Path]:
    """Draw ``summary``'s figures (see the module docstring) into ``directory`` (made if
    missing); the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    groups = _groups(summary["runs"])
    colours = _colours(list(groups))
    workload = summary["workload"]
    written = []

    def save(fig: Any, figure: str) -> None:
        path = directory / PLOT_FILES[figure]
        fig.savefig(path)
        written.append(path)

    for figure, xy, xlabel in (
        ("metric_time", _evaluation_times, "training seconds (evaluation excluded)"),
        ("metric_bytes", _evaluation_bytes, "MB one worker sent"),
    ):
        fig, ax = _figure()
        ax.axhline(workload["target"], color="grey", linestyle="--", label="target")
        _draw_runs(ax, groups, colours, xy, marker=".")
        _finish(ax, xlabel, workload["metric"], log_x=figure == "metric_bytes")
        save(fig, figure)

    gravac = {name: runs for name, runs in groups.items() if len(_cf_logs(runs))}
    if not gravac:
        return written
    fig, ax = _figure()
    _draw_runs(ax, gravac, colours, _cf_steps, drawstyle="steps-post")  # a CF holds a step
    ax.set_yscale("log")
    _finish(ax, "step", "CF sent (1: dense)")
    save(fig, "cf_steps")

    fig, (kde_ax, hist_ax) = _figure(_WIDE_FIGSIZE, columns=2)
    _draw_density(kde_ax, hist_ax, gravac, colours)
    save(fig, "cf_density")
    return written
