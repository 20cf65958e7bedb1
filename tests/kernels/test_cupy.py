"""CuPy kernels against their torch references on the same GPU (skipped without CUDA + CuPy)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from gravac import compressors
from gravac.compressors import Round
from gravac.compressors.base import payload_tensors
from gravac.compressors.thc import THCCompressor
from gravac.kernels import (
    resolve_backend,
    scaled_cast,
    scatter_add,
    threshold_indices,
    topk_indices,
    unpack_lookup_sum,
)
from gravac.kernels.quantize import pack_bits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
        reason="needs a CUDA GPU and CuPy",
    ),
]

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Odd sizes: below a warp, not a multiple of a tile (2048), several tiles, and the empty tensor.
SIZES = [0, 1, 7, 1000, 2049, 100_003]


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(n, generator=gen, device="cuda").to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    assert torch.equal(a.view(width), b.view(width))


def test_none_picks_cupy_for_cuda_tensors_and_torch_for_cpu() -> None:
    x = torch.zeros(4, device="cuda")
    assert resolve_backend(x, None, op="topk", cupy=True) == "cupy"
    assert resolve_backend(x, None, op="fwht", cupy=False) == "torch"
    assert resolve_backend(x.cpu(), None, op="topk", cupy=True) == "torch"
    with pytest.raises(RuntimeError, match="needs a CUDA tensor"):
        resolve_backend(x.cpu(), "cupy", op="topk", cupy=True)
    with pytest.raises(RuntimeError, match="no kernel for fwht"):
        resolve_backend(x, "cupy", op="fwht", cupy=False)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", SIZES)
def test_topk_selects_the_k_largest_magnitudes(dtype: torch.dtype, n: int) -> None:
    x = _data(n, dtype)
    for k in sorted({min(1, n), n // 100, n // 3, max(n - 1, 0), n}):
        got = topk_indices(x, k, backend="cupy")
        ref = topk_indices(x, k, backend="torch")
        assert got.dtype == torch.int64 and got.numel() == k
        assert got.unique().numel() == k
        # Equal magnitudes may be chosen either way: compare the selected magnitudes, and the
        # index sets exactly where magnitudes are distinct (float32 / float64 normals).
        mag = x.abs().double()
        assert torch.equal(mag[got].sort().values, mag[ref].sort().values)
        if dtype in (torch.float32, torch.float64):
            assert torch.equal(got.sort().values, ref.sort().values)


def test_topk_selects_nan_and_inf_first() -> None:
    x = _data(10_000, torch.float32)
    x[[5, 77, 9000]] = torch.tensor([math.nan, math.inf, -math.inf], device="cuda")
    got = topk_indices(x, 3, backend="cupy")
    assert sorted(got.tolist()) == [5, 77, 9000]


@pytest.mark.parametrize("dtype", FLOATS)
def test_topk_large_input_through_the_sampled_range(dtype: torch.dtype) -> None:
    x = _data(1_000_003, dtype, seed=5) * _data(1_000_003, dtype, seed=6).float().exp().to(dtype)
    for k in (1, 10_000, 999_000):
        got = topk_indices(x, k, backend="cupy")
        ref = topk_indices(x, k, backend="torch")
        mag = x.abs().double()
        assert got.unique().numel() == k
        assert torch.equal(mag[got].sort().values, mag[ref].sort().values)


def test_topk_falls_back_when_the_sample_misses_the_large_values() -> None:
    """Only positions the strided sample skips are non-zero: the histogram decides, exactly."""
    n, k = 1_000_003, 1000
    x = torch.zeros(n, device="cuda")
    hot = torch.arange(k, device="cuda") * 15 + 7  # the sample takes every 15th element from 0
    x[hot] = torch.arange(1, k + 1, device="cuda", dtype=torch.float32)
    got = topk_indices(x, k, backend="cupy")
    assert torch.equal(got.sort().values, hot)


def test_topk_with_all_values_equal_is_exact() -> None:
    x = torch.full((5000,), 0.25, device="cuda")
    got = topk_indices(x, 50, backend="cupy")
    assert got.unique().numel() == 50


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", SIZES)
def test_threshold_matches_nonzero_in_order(dtype: torch.dtype, n: int) -> None:
    x = _data(n, dtype, seed=1)
    if n:
        x[n // 2] = math.nan
    for threshold in (0.0, 0.3, 1.7, 10.0):
        got = threshold_indices(x, threshold, backend="cupy")
        assert torch.equal(got, threshold_indices(x, threshold, backend="torch"))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("k", [0, 1, 999, 50_000])
def test_scatter_add_sums_repeats(dtype: torch.dtype, index_dtype: torch.dtype, k: int) -> None:
    numel = 10_007
    gen = torch.Generator(device="cuda").manual_seed(k)
    idx = torch.randint(0, numel, (k,), generator=gen, device="cuda").to(index_dtype)
    # Small integers: every partial sum is exact in every dtype, so the order does not matter.
    values = torch.randint(-4, 5, (k,), generator=gen, device="cuda").to(dtype)
    got = scatter_add(numel, idx, values, backend="cupy")
    _same_bits(got, scatter_add(numel, idx, values, backend="torch"))


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divisor", [1, 3, 8])
def test_scaled_cast_is_bit_exact(src: torch.dtype, wire: torch.dtype, divisor: int) -> None:
    x = _data(100_003, torch.float64, seed=2).mul_(1e3)
    x[:6] = torch.tensor([math.nan, math.inf, -math.inf, 1e6, -1e6, 1e-30], dtype=torch.float64)
    x = x.to(src)
    got = scaled_cast(x, wire, divisor=divisor, backend="cupy")
    ref = scaled_cast(x, wire, divisor=divisor, backend="torch")
    _same_bits(got, ref)
    assert scaled_cast(x[:0], wire, backend="cupy").numel() == 0


THC_CASES = [
    # (rotation, partial stages, numel): the generic block kernel (blocks below 128), the register
    # kernel (128 ... 4096, with and without shared-memory stages), and blocks above 4096
    # (torch's rotation, then the fused rest).
    ("partial", 10, 1),
    ("partial", 5, 1000),
    ("partial", 7, 1000),
    ("partial", 10, 100_003),
    ("full", 10, 3),
    ("full", 10, 4000),
    ("full", 10, 70_001),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("rotation", "stages", "n"), THC_CASES)
@pytest.mark.parametrize("transport", ["allreduce", "allgather"])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_thc_payload_is_bit_exact(
    dtype: torch.dtype, rotation: str, stages: int, n: int, transport: str, bits: int
) -> None:
    x = _data(n, dtype, seed=3)
    rnd = Round(step=7, key=3, world_size=1)
    payloads = []
    for backend in ("cupy", "torch"):
        c = THCCompressor(
            bits=bits,
            rotation=rotation,  # type: ignore[arg-type]
            partial_stages=stages,
            transport=transport,  # type: ignore[arg-type]
            backend=backend,
        )
        payloads.append(c.compress(x, 8.0, rnd)[0])
    for got, ref in zip(payload_tensors(payloads[0]), payload_tensors(payloads[1]), strict=True):
        _same_bits(got, ref)


def test_thc_empty_input() -> None:
    c = THCCompressor(backend="cupy")
    payload, ctx = c.compress(torch.zeros(0, device="cuda"), 8.0, Round(0, 0, 1))
    assert c.decompress(payload, ctx).numel() == 0


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 5, 12_345])
def test_unpack_lookup_sum_matches_reference(bits: int, numel: int) -> None:
    table = torch.arange(2**bits) * 3
    gen = torch.Generator(device="cuda").manual_seed(bits)
    packed = [
        pack_bits(torch.randint(0, 2**bits, (numel,), generator=gen, device="cuda"), bits)
        for _ in range(3)
    ]
    got = unpack_lookup_sum(packed, bits, numel, table, backend="cupy")
    assert torch.equal(got, unpack_lookup_sum(packed, bits, numel, table, backend="torch"))


@pytest.mark.parametrize("name", ["topk", "redsync", "dgc", "fp16", "bf16", "thc"])
def test_compressor_on_cuda_equals_torch_backend(name: str) -> None:
    x = _data(50_000, torch.float32, seed=4)
    outs = []
    for backend in ("cupy", "torch"):
        c = compressors.create(name, backend=backend)
        agreed = c.local_stats(x, 100.0, Round(step=100))
        payload, ctx = c.compress(x, 100.0, Round(step=100, world_size=2, agreed=agreed))
        outs.append(c.decompress(payload, ctx))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_cupy_views_share_the_tensor_memory() -> None:
    from gravac.kernels.cupy_runtime import as_cupy, as_cupy_dlpack, torch_stream

    t = torch.zeros(5, device="cuda", dtype=torch.bfloat16)
    with torch_stream(t.device):
        as_cupy(t)[1] = 0x3F80  # the bits of bfloat16 1.0
        as_cupy_dlpack(t)[3] = 0x4000  # 2.0
    torch.cuda.synchronize()
    assert t.tolist() == [0.0, 1.0, 0.0, 2.0, 0.0]
