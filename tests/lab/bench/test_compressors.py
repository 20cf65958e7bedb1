"""``gravac bench compressors``: rows, stateful compressors, failures (timing is not asserted)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import pytest
from torch import Tensor

from gravac import compressors
from gravac.compressors import Compressor, Context, Payload, Round, registry
from gravac.compressors.dense import DensePayload
from gravac_lab.bench import common
from gravac_lab.bench import compressors as bench_compressors

SIZE = 4096
WORKERS = 2


@dataclasses.dataclass(frozen=True)
class _SeenContext(Context):
    pass


class _StatefulFake(Compressor):
    """Dense all-reduce whose state (a round counter) advances in ``combine``, like PowerSGD.

    Records the counter every compress and combine call sees, and the layouts it is given.
    """

    name: ClassVar[str] = "bench-test-stateful"
    collective = "allreduce"
    seen: ClassVar[list[tuple[str, int]]] = []
    layouts: ClassVar[list[object]] = []

    def __init__(self) -> None:
        self.rounds = 0

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[Payload, Context]:
        self.seen.append(("compress", self.rounds))
        self.layouts.append(rnd.layout)
        flat = x.detach().reshape(-1).clone()
        return DensePayload(values=flat), _SeenContext(x.shape, x.dtype, flat.numel(), 1.0)

    def decompress(self, payload: Payload, ctx: Context) -> Tensor:
        return cast(DensePayload, payload).values.view(ctx.shape)

    def combine(
        self, payloads: Sequence[Payload], ctx: Context, out: Tensor | None = None
    ) -> Tensor:
        self.seen.append(("combine", self.rounds))
        self.rounds += 1
        return super().combine(payloads, ctx, out)

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])


def test_stateful_compressor_is_timed_from_the_same_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._REGISTRY._classes, _StatefulFake.name, _StatefulFake)
    monkeypatch.setattr(_StatefulFake, "seen", [])
    monkeypatch.setattr(_StatefulFake, "layouts", [])
    grads = common.synthetic_gradients(SIZE, WORKERS, seed=0)
    layout = common.model_layout(SIZE)
    result = bench_compressors.bench_compressor(
        _StatefulFake.name, grads, cf=10.0, repeats=3, layout=layout
    )
    assert result.stateful
    assert result.nmse < 1e-12
    # The NMSE round (WORKERS compresses, one combine) starts from the initial state; every
    # later call, warm-up and timed ones alike, from the state that round left.
    first = [("compress", 0)] * WORKERS + [("combine", 0)]
    assert _StatefulFake.seen[: len(first)] == first
    assert set(_StatefulFake.seen[len(first) :]) == {("compress", 1), ("combine", 1)}
    assert all(seen == layout for seen in _StatefulFake.layouts)


@pytest.mark.parametrize("name", compressors.names())
def test_bench_compressor_row(name: str) -> None:
    grads = common.synthetic_gradients(SIZE, WORKERS, seed=0)
    r = bench_compressors.bench_compressor(
        name, grads, cf=bench_compressors.DEFAULT_CF, repeats=1, layout=common.model_layout(SIZE)
    )
    assert r.name == name
    assert (r.size, r.workers, r.repeats) == (SIZE, WORKERS, 1)
    assert r.achieved_cf >= 1.0
    assert 0 < r.wire_bytes <= SIZE * common.ELEMENT_BYTES
    assert r.nmse >= 0.0
    for value in (r.input_gbps, r.copy_gbps, r.decompress_gbps, r.ratio_to_copy):
        assert value > 0.0
    assert r.ratio_to_copy == pytest.approx(r.input_gbps / r.copy_gbps)
    assert r.feedback_s > 0.0 and r.dense_feedback_s > 0.0
    assert r.ef_ratio == pytest.approx(r.feedback_s / r.dense_feedback_s)


def test_bench_compressors_reports_a_failing_compressor_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken(_StatefulFake):
        name: ClassVar[str] = "bench-test-broken"

        def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[Payload, Context]:
            raise ArithmeticError("boom")

    monkeypatch.setitem(registry._REGISTRY._classes, Broken.name, Broken)
    with pytest.raises(RuntimeError, match=r"bench-test-broken.*boom"):
        bench_compressors.bench_compressors([Broken.name], size=64, workers=1, repeats=1)
