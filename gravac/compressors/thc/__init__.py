"""THC: Tensor Homomorphic Compression (Li et al., "THC: Accelerating Distributed Deep Learning
Using Tensor Homomorphic Compression", NSDI 2024; docs/design.md section 10).

Every rank quantises its gradient onto integer levels that can be *summed* by the collective and
decompressed once, after aggregation (the pipeline, step by step, opens
:mod:`~gravac.compressors.thc.encoding`).

One module a job:

* :mod:`~gravac.compressors.thc.table`: the optimal table ``T_{b,g,p}`` by an exact dynamic
  program.
* :mod:`~gravac.compressors.thc.lanes`: the all-reduce's integer lanes in int64 words.
* :mod:`~gravac.compressors.thc.records`: what a round is encoded with, what travels, what the
  sender keeps.
* :mod:`~gravac.compressors.thc.encoding`: the reference encoding and decoding (the rotation,
  the per-block scale, the clamp and the hashed stochastic rounding), and the CUDA dispatch.
* :mod:`~gravac.compressors.thc.cpu`: the same on CPU tensors in float32, chunked in reused
  buffers, because the reference is an order of magnitude slower there (measurements in
  docs/studies/2026-11-30-thc-cpu.md).
* :mod:`~gravac.compressors.thc.compressor`: :class:`THCCompressor` (options, CF -> bits, the
  transports, the defaults per bit width).
"""

from gravac.compressors.thc.compressor import (
    DEFAULT_GRANULARITY,
    DEFAULT_P,
    DEFAULT_PARTIAL_STAGES,
    THCCompressor,
    bits_for_cf,
)
from gravac.compressors.thc.encoding import (
    block_norms,
    block_scale,
    thc_decode,
    thc_encode,
    thc_payload,
)
from gravac.compressors.thc.lanes import (
    LANE_WORD_BITS,
    lane_bits,
    lanes_per_word,
    pack_lanes,
    unpack_lanes,
)
from gravac.compressors.thc.records import (
    Encoding,
    THCContext,
    THCLevelsPayload,
    THCPackedPayload,
)

__all__ = [
    "DEFAULT_GRANULARITY",
    "DEFAULT_P",
    "DEFAULT_PARTIAL_STAGES",
    "LANE_WORD_BITS",
    "Encoding",
    "THCCompressor",
    "THCContext",
    "THCLevelsPayload",
    "THCPackedPayload",
    "bits_for_cf",
    "block_norms",
    "block_scale",
    "lane_bits",
    "lanes_per_word",
    "pack_lanes",
    "thc_decode",
    "thc_encode",
    "thc_payload",
    "unpack_lanes",
]
