"""``gravac compare``: DDP, its compression hooks and gravac measured on the same run.

One module a job:

* :mod:`gravac.compare.workloads`: what is trained (model, data, metric, target);
* :mod:`gravac.compare.modes`: how gradients are exchanged (``ddp``, ``ddp-fp16``,
  ``ddp-powersgd``, ``gravac``, ``gravac-ddp``) and what each reports per step;
* :mod:`gravac.compare.config`: every option, checked before any worker starts;
* :mod:`gravac.compare.netns`: loopback, or ``tc``-shaped veth links between namespaces;
* :mod:`gravac.compare.train`: one worker's training loop and link test;
* :mod:`gravac.compare.worker`: the worker process (``python -m gravac.compare.worker``);
* :mod:`gravac.compare.runner`: the network, then every mode's workers, then the summary;
* :mod:`gravac.compare.report`: medians and time to target, the markdown table;
* :mod:`gravac.compare.cli`: the command line, :func:`add_parser`.

This package re-exports the names a caller needs to run a comparison from Python.
"""

from __future__ import annotations

from gravac.compare.cli import add_parser
from gravac.compare.config import CompareConfig
from gravac.compare.modes import MODES, Mode, StepFigures
from gravac.compare.report import ModeSummary, format_table
from gravac.compare.runner import CompareError, run_compare
from gravac.compare.workloads import WORKLOADS, Workload

__all__ = [
    "MODES",
    "WORKLOADS",
    "CompareConfig",
    "CompareError",
    "Mode",
    "ModeSummary",
    "StepFigures",
    "Workload",
    "add_parser",
    "format_table",
    "run_compare",
]
