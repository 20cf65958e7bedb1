"""Integer lanes in int64 words: THC's all-reduce transport (docs/design.md section 10).

THC's levels are integers that the collective can *sum* (Li et al., NSDI 2024). On the
all-reduce each rank sends the level ``T[z]`` in ``0..g`` of every padded element in a lane of
``w = ceil(log2(N g + 1))`` bits (:func:`lane_bits`), ``floor(64 / w)`` lanes to an int64 word
(:func:`lanes_per_word`, :func:`pack_lanes`)::

    words_i = pack_lanes(T[z_i], w)        sum_i words_i  ->  unpack_lanes  ->  sum_i T[z_i]

gloo and NCCL sum int64 words exactly (two's complement wraparound is exact modulo 2^64, and no
lane's sum reaches ``2^w``, so no carry crosses a lane), so the summed words unpack
(:func:`unpack_lanes`) to the sum of the ranks' levels. The wire CF is then
``32 floor(64 / w) / 64`` (:mod:`gravac.compressors.thc.compressor`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["LANE_WORD_BITS", "lane_bits", "lanes_per_word", "pack_lanes", "unpack_lanes"]

#: Bits of the all-reduce's integer word, int64: gloo and NCCL both sum int64 exactly (gloo has
#: no unsigned 64-bit sum; int32 words would waste more bits to padding). Lanes may use all 64
#: bits: the top lane's sum can reach the sign bit, and the collectives add two's complement
#: words with wraparound, which is exact modulo 2^64, so every lane (its true sum < 2^width)
#: comes back exactly.
LANE_WORD_BITS = 64


def lane_bits(granularity: int, world_size: int) -> int:
    """Width ``w = ceil(log2(N g + 1))`` of a lane that holds the sum of ``N`` levels in 0..g.

    Raises:
        ValueError: no lane of at most :data:`LANE_WORD_BITS` bits holds ``N g``.
    """
    if granularity < 1 or world_size < 1:
        raise ValueError(
            f"granularity and world_size must be >= 1, got {granularity} and {world_size}"
        )
    width = (granularity * world_size).bit_length()
    if width > LANE_WORD_BITS:
        raise ValueError(
            f"the sum over world_size={world_size} ranks of levels up to granularity="
            f"{granularity} needs {width} bits, more than a {LANE_WORD_BITS}-bit word; use a "
            "smaller granularity (or bits) or the allgather transport"
        )
    return width


def lanes_per_word(width: int) -> int:
    """Lanes of ``width`` bits in one :data:`LANE_WORD_BITS`-bit word."""
    return LANE_WORD_BITS // width


def _word_count(numel: int, width: int) -> int:
    return -(-numel // lanes_per_word(width))


def _lane_runs(start: int, end: int, words: int, width: int) -> Iterator[tuple[int, int, int]]:
    """Elements ``[start, end)`` of :func:`pack_lanes`' planar layout over ``words`` words, split
    by lane: ``(shift, first, stop)``, elements ``first..stop`` sitting at bit ``shift`` of words
    ``first mod words ..``, consecutively."""
    pos = start
    while pos < end:
        lane = pos // words
        stop = min(end, (lane + 1) * words)
        yield lane * width, pos, stop
        pos = stop


def pack_lanes(levels: Tensor, width: int) -> Tensor:
    """Pack 1-D non-negative ``levels`` (each below ``2^width``) into int64 words.

    Planar layout: with ``W = ceil(n / L)`` words of ``L`` lanes, element ``i`` sits in word
    ``i mod W`` at bits ``[(i // W) w, (i // W + 1) w)``, so lane ``k`` of every word is the
    contiguous run ``levels[k W : (k + 1) W]`` (zero-padded at the end). Summing the words of
    several ranks sums every lane, without carries across lanes while each lane's sum stays
    below ``2^width`` (:func:`lane_bits`).
    """
    n = levels.numel()
    words = _word_count(n, width)
    out = torch.zeros(words, dtype=torch.int64, device=levels.device)
    flat = levels.reshape(-1)
    for shift, first, stop in _lane_runs(0, n, words, width):
        word = first % words
        run = torch.bitwise_left_shift(flat[first:stop].long(), shift)
        out[word : word + stop - first].bitwise_or_(run)
    return out


def unpack_lanes(words: Tensor, width: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_lanes` (also of summed words): the first ``numel`` lanes, int64."""
    if words.numel() != _word_count(numel, width):
        raise ValueError(
            f"{numel} lanes of {width} bits pack into {_word_count(numel, width)} words, "
            f"got {words.numel()}"
        )
    out = torch.empty(numel, dtype=torch.int64, device=words.device)
    count, mask = words.numel(), (1 << width) - 1
    for shift, first, stop in _lane_runs(0, numel, count, width):
        word = first % count
        run = out[first:stop]
        torch.bitwise_right_shift(words[word : word + stop - first], shift, out=run)
        run.bitwise_and_(mask)
    return out
