"""The compressor benchmark's building blocks (no timing assertions: timing is the benchmark's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import pytest
import torch
from torch import Tensor

from gravac import bench, compressors
from gravac.compressors import Compressor, Context, Payload, Round, registry
from gravac.compressors.dense import DensePayload

SIZE = 4096
WORKERS = 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16M", 16 * 2**20),
        ("512K", 512 * 2**10),
        ("1G", 2**30),
        ("4k", 4096),
        ("1000", 1000),
        (" 7 ", 7),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert bench.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "0K", "-1", "1.5M", "16MB", "M", "abc", "1T", "1e6"])
def test_parse_size_rejects_bad_values_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--size") as info:
        bench.parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("size", [1, 3, 100, 4096, 12345, 2**20 + 17])
def test_model_layout_fills_the_bucket(size: int) -> None:
    layout = bench.model_layout(size)
    assert sum(s.numel() for s in layout) == size
    assert all(s.numel() > 0 for s in layout)


def test_model_layout_is_a_stack_of_matrices() -> None:
    layout = bench.model_layout(16 * 2**20)
    matrices = [s for s in layout if len(s) == 2]
    assert len(matrices) >= bench.MIN_MATRICES
    assert matrices[0] == torch.Size((512, 2048))
    assert matrices[1] == torch.Size((2048, 512))


def test_synthetic_gradients_are_seeded_heavy_tailed_and_correlated() -> None:
    a = bench.synthetic_gradients(SIZE, 3, seed=1)
    b = bench.synthetic_gradients(SIZE, 3, seed=1)
    c = bench.synthetic_gradients(SIZE, 3, seed=2)
    assert len(a) == 3
    assert all(g.shape == (SIZE,) and g.dtype == torch.float32 for g in a)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], a[1])
    # Workers share a component: positively correlated, far from identical.
    corr = torch.corrcoef(torch.stack(a))[0, 1]
    assert 0.2 < float(corr) < 0.9
    # Heavy tails: kurtosis well above a Gaussian's 3.
    z = (a[0] - a[0].mean()) / a[0].std()
    assert float(z.pow(4).mean()) > 6.0


def test_nmse() -> None:
    truth = torch.tensor([3.0, 4.0])
    assert bench.nmse(truth, truth) == 0.0
    assert bench.nmse(torch.zeros(2), truth) == pytest.approx(1.0)
    assert bench.nmse(torch.tensor([3.0, 3.0]), truth) == pytest.approx(1 / 25)
    assert bench.nmse(truth, torch.zeros(2)) != bench.nmse(truth, torch.zeros(2))  # NaN


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

    def combine(self, payloads: Sequence[Payload], ctx: Context) -> Tensor:
        self.seen.append(("combine", self.rounds))
        self.rounds += 1
        return super().combine(payloads, ctx)

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])


def test_stateful_compressor_is_timed_from_the_same_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._REGISTRY, _StatefulFake.name, _StatefulFake)
    monkeypatch.setattr(_StatefulFake, "seen", [])
    monkeypatch.setattr(_StatefulFake, "layouts", [])
    grads = bench.synthetic_gradients(SIZE, WORKERS, seed=0)
    layout = bench.model_layout(SIZE)
    result = bench.bench_compressor(_StatefulFake.name, grads, cf=10.0, repeats=3, layout=layout)
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
    grads = bench.synthetic_gradients(SIZE, WORKERS, seed=0)
    r = bench.bench_compressor(
        name, grads, cf=bench.DEFAULT_CF, repeats=1, layout=bench.model_layout(SIZE)
    )
    assert r.name == name
    assert (r.size, r.workers, r.repeats) == (SIZE, WORKERS, 1)
    assert r.achieved_cf >= 1.0
    assert 0 < r.wire_bytes <= SIZE * bench.ELEMENT_BYTES
    assert r.nmse >= 0.0
    for value in (r.input_gbps, r.copy_gbps, r.decompress_gbps, r.ratio_to_copy):
        assert value > 0.0
    assert r.ratio_to_copy == pytest.approx(r.input_gbps / r.copy_gbps)


def test_bench_compressors_reports_a_failing_compressor_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken(_StatefulFake):
        name: ClassVar[str] = "bench-test-broken"

        def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[Payload, Context]:
            raise ArithmeticError("boom")

    monkeypatch.setitem(registry._REGISTRY, Broken.name, Broken)
    with pytest.raises(RuntimeError, match=r"bench-test-broken.*boom"):
        bench.bench_compressors([Broken.name], size=64, workers=1, repeats=1)


def test_bench_multilevel_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="cf1 must be below cf2"):
        bench.bench_multilevel(size=64, cf1=100.0, cf2=10.0)
    with pytest.raises(ValueError, match="multi-level"):
        bench.bench_multilevel(["none"], size=64)


def test_bench_multilevel_matches_direct_cf() -> None:
    rows = bench.bench_multilevel(size=SIZE, cf1=10.0, cf2=100.0, repeats=1)
    assert [r.name for r in rows] == bench.multilevel_names()
    for r in rows:
        assert r.achieved_cf1 >= 1.0
        assert r.achieved_cf2_multilevel == pytest.approx(r.achieved_cf2_direct, rel=0.5)
        assert r.ratio > 0.0
