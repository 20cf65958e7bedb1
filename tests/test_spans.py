"""A unit's elements laid into a larger buffer by spans (gravac.spans)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gravac.spans import gather_spans, place_indices, scatter_spans, spans_of

#: tensors of a bucket: (numel, compressed?) in buffer order
TENSORS = st.lists(st.tuples(st.integers(0, 40), st.booleans()), min_size=1, max_size=8)


def test_adjacent_tensors_of_a_kind_share_a_span() -> None:
    numels, kinds = [3, 4, 2, 5, 1], [False, True, True, False, True]
    assert spans_of(numels, kinds, True) == ((3, 9), (14, 15))
    assert spans_of(numels, kinds, False) == ((0, 3), (9, 14))


@settings(max_examples=60, deadline=None)
@given(TENSORS, st.data())
def test_flat_positions_move_to_the_buffer_positions_they_were_gathered_from(
    tensors: list[tuple[int, bool]], data: st.DataObject
) -> None:
    numels, kinds = [n for n, _ in tensors], [k for _, k in tensors]
    spans = spans_of(numels, kinds, True)
    size = sum(b - a for a, b in spans)
    buffer = torch.arange(sum(numels), dtype=torch.float64)
    flat = torch.empty(size, dtype=torch.float64)
    gather_spans(buffer, spans, flat)  # flat[i] = the buffer position it came from
    if size:
        picked = data.draw(st.lists(st.integers(0, size - 1), max_size=30))
        indices = torch.tensor(picked, dtype=torch.int32)
        assert torch.equal(place_indices(indices, spans), flat[indices.long()].long())
    back = torch.full_like(buffer, -1.0)
    scatter_spans(back, spans, flat)
    inside = back >= 0
    assert torch.equal(back[inside], buffer[inside])
    assert int(inside.sum()) == size


def test_gathering_adds_what_is_given_in_the_same_pass() -> None:
    buffer = torch.arange(10.0)
    spans = ((1, 3), (6, 9))
    out = torch.empty(5)
    gather_spans(buffer, spans, out, plus=torch.full((5,), 0.5))
    assert out.tolist() == [1.5, 2.5, 6.5, 7.5, 8.5]
