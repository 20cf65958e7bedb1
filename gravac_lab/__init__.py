"""gravac's lab: the research harnesses, apart from the runtime package.

* :mod:`gravac_lab.compare`: DDP, its compression hooks and gravac trained side by side on the
  same (optionally ``tc``-shaped) link: step time and its split, bytes, time to a target.
* :mod:`gravac_lab.bench`: micro-benchmarks of the compressors, multi-level compression, the
  kernels, memory and the shadow replay, each printing ratios measured in the same run.

Both are reached through the ``gravac`` command line (``gravac compare``, ``gravac bench``),
which finds them through the ``gravac.commands`` entry points; ``import gravac`` imports
neither. Install the extra they need with ``pip install 'gravac[lab]'``.
"""

__all__: list[str] = []
