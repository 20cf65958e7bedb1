"""``gravac compare``: DDP, its compression hooks and gravac variants measured over seeds.

One module a job:

* :mod:`gravac_lab.compare.workloads`: what is trained (model, data, metric, target);
* :mod:`gravac_lab.compare.modes`: how gradients are exchanged (``ddp``, ``ddp-fp16``,
  ``ddp-powersgd``, ``gravac``, ``gravac-ddp``) and what each reports per step;
* :mod:`gravac_lab.compare.config`: every option of one run, checked before any worker starts;
* :mod:`gravac_lab.compare.study`: the gravac variants (``--variant``) and seeds (``--seeds``),
  and the jobs they make: every mode, variant and seed;
* :mod:`gravac_lab.compare.layout`: the workers grouped into nodes (``--nodes``,
  ``--ranks-per-node``);
* :mod:`gravac_lab.compare.netns`: loopback, or ``tc``-shaped veth links between namespaces
  (one a node), and the bytes they sent;
* :mod:`gravac_lab.compare.train`: one worker's training loop and link test;
* :mod:`gravac_lab.compare.worker`: one rank's work in a job, in a process of its own;
* :mod:`gravac_lab.compare.forkserver`: a rank's fork server, which forks its worker of every
  job (``python -m gravac_lab.compare.forkserver``), and :mod:`gravac_lab.compare.host`, the
  runner's handle on it;
* :mod:`gravac_lab.compare.runner`: the network, then every job's workers, then the summary;
* :mod:`gravac_lab.compare.report`: a run's medians, time to target and per-step series, the
  markdown table;
* :mod:`gravac_lab.compare.aggregate`: each mode and variant's median and range over the seeds;
* :mod:`gravac_lab.compare.export`: the JSON and the CSV (a row a run);
* :mod:`gravac_lab.compare.plots`: the figures (metric against time and bytes, CF over steps and
  its density);
* :mod:`gravac_lab.compare.scoreboard`: the scoreboard's bar, time to it, yardstick and ratios,
  over stored results; :mod:`gravac_lab.compare.scoreboard_plan`: its setups and the studies it
  trains; :mod:`gravac_lab.compare.scoreboard_table`: its markdown;
  :mod:`gravac_lab.compare.scoreboard_cli`: ``--scoreboard`` and its options;
* :mod:`gravac_lab.compare.cli`: the command line, :func:`add_parser`.

This package re-exports the names a caller needs to run a comparison from Python.
"""

from __future__ import annotations

from gravac_lab.compare.aggregate import Aggregate, Spread, aggregate
from gravac_lab.compare.cli import add_parser
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.export import write_csv, write_json
from gravac_lab.compare.layout import NodeLayout
from gravac_lab.compare.modes import MODES, Mode, StepFigures
from gravac_lab.compare.plots import write_plots
from gravac_lab.compare.report import ModeSummary, format_table
from gravac_lab.compare.runner import CompareError, run_compare
from gravac_lab.compare.study import Study, Variant, parse_variant
from gravac_lab.compare.workloads import WORKLOADS, Workload

__all__ = [
    "MODES",
    "WORKLOADS",
    "Aggregate",
    "CompareConfig",
    "CompareError",
    "Mode",
    "ModeSummary",
    "NodeLayout",
    "Spread",
    "StepFigures",
    "Study",
    "Variant",
    "Workload",
    "add_parser",
    "aggregate",
    "format_table",
    "parse_variant",
    "run_compare",
    "write_csv",
    "write_json",
    "write_plots",
]
