"""A unit's elements laid into a larger flat buffer by spans (the DDP hook's mixed buckets).

DDP fills a bucket with its tensors in reverse parameter order, so a bucket can interleave the
tensors gravac compresses with the 1-D ones that travel dense (docs/design.md section 3). Each kind
is one engine unit, whose flat gradient is the bucket's *spans* of that kind, concatenated:

    spans = ((a_1, b_1), ..., (a_m, b_m)),  a_1 < b_1 <= a_2 < ...;
    flat[o_j : o_j + (b_j - a_j)] = buffer[a_j : b_j],  o_j = sum_{i<j} (b_i - a_i)

:func:`gather_spans` and :func:`scatter_spans` copy between the two layouts; a compressor that
writes its aggregate element by element writes it straight into the buffer instead
(:meth:`gravac.compressors.base.Compressor.combine_mean_placed`), with flat positions moved to
buffer positions by :func:`place_indices`: no copy of the aggregate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "Place",
    "Spans",
    "gather_spans",
    "place_indices",
    "scatter_spans",
    "span_pieces",
    "spans_numel",
    "spans_of",
]

#: ``(start, end)`` ranges of a flat buffer, not overlapping, in increasing order (the DDP
#: hook in two levels passes :func:`gather_spans` and :func:`scatter_spans`, which take any
#: order, its tensors' ranges in parameter order)
Spans = tuple[tuple[int, int], ...]
#: a flat buffer and the spans of it that a unit's elements lie in
Place = tuple[Tensor, Spans]


def spans_of(numels: Sequence[int], kinds: Sequence[bool], kind: bool) -> Spans:
    """The buffer ranges of the tensors of ``kind`` (``numels`` and ``kinds`` in buffer order),
    adjacent ones merged."""
    out: list[tuple[int, int]] = []
    offset = 0
    for n, k in zip(numels, kinds, strict=True):
        end = offset + n
        if k == kind:
            if out and out[-1][1] == offset:
                out[-1] = (out[-1][0], end)
            else:
                out.append((offset, end))
        offset = end
    return tuple(out)


def spans_numel(spans: Spans) -> int:
    """How many elements ``spans`` cover: the size of the flat layout."""
    return sum(b - a for a, b in spans)


def span_pieces(spans: Spans) -> list[tuple[slice, slice]]:
    """Per span, ``(buffer slice, flat slice)``: where its elements lie in each layout."""
    pieces = []
    offset = 0
    for a, b in spans:
        pieces.append((slice(a, b), slice(offset, offset + b - a)))
        offset += b - a
    return pieces


def gather_spans(buffer: Tensor, spans: Spans, out: Tensor, plus: Tensor | None = None) -> None:
    """The buffer's ``spans``, concatenated into the flat ``out``, plus the flat ``plus`` where
    given (in the same pass)."""
    for in_buffer, in_flat in span_pieces(spans):
        if plus is None:
            out[in_flat].copy_(buffer[in_buffer])
        else:
            torch.add(buffer[in_buffer], plus[in_flat], out=out[in_flat])


def scatter_spans(buffer: Tensor, spans: Spans, flat: Tensor) -> None:
    """Write the flat ``flat`` into the buffer's ``spans``, in order (:func:`gather_spans`'s
    inverse)."""
    for in_buffer, in_flat in span_pieces(spans):
        buffer[in_buffer].copy_(flat[in_flat])


def place_indices(indices: Tensor, spans: Spans) -> Tensor:
    """The buffer positions (int64) of flat positions ``indices`` (any integer dtype): a flat
    position ``i`` in span ``j`` (``o_j <= i < o_{j+1}``) lies at ``i - o_j + a_j``.

    One comparison pass over ``indices`` per boundary between spans (``len(spans) - 1``), as
    :data:`gravac.compressors.sparse.PLACE_RATIO` counts them: a binary search per index
    (``torch.bucketize``) took 0.86 ms for 105K indices in two spans, one pass 0.24 ms.
    """
    flat = indices.reshape(-1).long()
    shifts = [
        (in_buffer.start - in_flat.start, in_flat.start)
        for in_buffer, in_flat in span_pieces(spans)
    ]
    placed = flat + shifts[0][0]
    for (shift, start), (before, _) in zip(shifts[1:], shifts, strict=False):
        placed += (flat >= start) * (shift - before)
    return placed
