"""Compressor benchmarks: ``gravac bench compressors`` and ``gravac bench multilevel``.

One module a job:

* :mod:`gravac_lab.bench.common`: the synthetic gradients and model layout, NMSE, the timing loop
  (medians after one warm-up), compressor instances in a fixed state, table layout;
* :mod:`gravac_lab.bench.compressors`: throughput, NMSE, achieved CF and wire bytes of each
  compressor (``gravac bench compressors``);
* :mod:`gravac_lab.bench.multilevel`: multi-level compression against compressing twice
  (``gravac bench multilevel``);
* :mod:`gravac_lab.bench.memory`: the extra peak memory of a training step per compressor
  (``gravac bench memory``);
* :mod:`gravac_lab.bench.step`: what gravac adds to a training step of a real model on one
  device (``gravac bench step``);
* :mod:`gravac_lab.bench.cli`: their command line, :func:`add_parser`.

This package re-exports the public names of those modules.
"""

from __future__ import annotations

from gravac_lab.bench.cli import add_parser
from gravac_lab.bench.common import (
    BENCH_KEY,
    BENCH_STEP,
    BYTES_PER_GB,
    DEFAULT_REPEATS,
    DEFAULT_SEED,
    DEFAULT_SIZE,
    ELEMENT_BYTES,
    LOG_SCALE_STD,
    MIN_MATRICES,
    MLP_EXPANSION,
    NOISE_RATIO,
    SIZE_SUFFIXES,
    model_layout,
    nmse,
    parse_size,
    synthetic_gradients,
)
from gravac_lab.bench.compressors import (
    DEFAULT_CF,
    DEFAULT_WORKERS,
    CompressorResult,
    bench_compressor,
    bench_compressors,
    format_compressor_table,
)
from gravac_lab.bench.memory import MemoryResult, bench_memory, format_memory_table
from gravac_lab.bench.multilevel import (
    DEFAULT_CF1,
    DEFAULT_CF2,
    MultilevelResult,
    bench_multilevel,
    format_multilevel_table,
    multilevel_names,
)

__all__ = [
    "BENCH_KEY",
    "BENCH_STEP",
    "BYTES_PER_GB",
    "DEFAULT_CF",
    "DEFAULT_CF1",
    "DEFAULT_CF2",
    "DEFAULT_REPEATS",
    "DEFAULT_SEED",
    "DEFAULT_SIZE",
    "DEFAULT_WORKERS",
    "ELEMENT_BYTES",
    "LOG_SCALE_STD",
    "MIN_MATRICES",
    "MLP_EXPANSION",
    "NOISE_RATIO",
    "SIZE_SUFFIXES",
    "CompressorResult",
    "MemoryResult",
    "MultilevelResult",
    "add_parser",
    "bench_compressor",
    "bench_compressors",
    "bench_memory",
    "bench_multilevel",
    "format_compressor_table",
    "format_memory_table",
    "format_multilevel_table",
    "model_layout",
    "multilevel_names",
    "nmse",
    "parse_size",
    "synthetic_gradients",
]
