"""flush_subnormal_: float32/float64 subnormals to +0 in place on the CPU, nothing else."""

from __future__ import annotations

import math

import pytest
import torch

from gravac.kernels.subnormal import flush_subnormal_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_flush_zeroes_exactly_the_subnormal_entries_in_place(dtype: torch.dtype) -> None:
    tiny = torch.finfo(dtype).tiny
    edges = torch.tensor([tiny, -tiny, math.nan, math.inf, -math.inf, 1.0, 0.0], dtype=dtype)
    below = torch.nextafter(torch.tensor([tiny, -tiny], dtype=dtype), torch.zeros(2, dtype=dtype))
    x = torch.cat([edges, below, below / 1024, torch.tensor([-0.0], dtype=dtype)])
    want = x.clone()
    want[edges.numel() :] = 0.0
    got = flush_subnormal_(x)
    assert got.data_ptr() == x.data_ptr()
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and bool(got[2].isnan())
    assert not bool(torch.signbit(got[edges.numel() :]).any())  # -0 and negatives: +0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_flush_leaves_16_bit_tensors_alone(dtype: torch.dtype) -> None:
    x = torch.tensor([torch.finfo(dtype).tiny / 4, 1.0], dtype=dtype)
    assert torch.equal(flush_subnormal_(x.clone()), x)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flush_leaves_gpu_tensors_alone() -> None:
    x = torch.tensor([1e-40, 1.0], device="cuda")
    assert torch.equal(flush_subnormal_(x.clone()), x)
