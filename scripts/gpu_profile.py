"""Per-kernel CUDA times of the CuPy top-k and THC paths at 64M elements (torch.profiler).

A diagnostic for scripts/gpu_check.sh: which launch of a composite operation costs what.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from gravac.bench.common import synthetic_gradients
from gravac.compressors import Round
from gravac.compressors.thc import THCCompressor
from gravac.kernels import threshold_indices, topk_indices

SIZE = 64 * 2**20
REPEATS = 5


def main() -> None:
    x = synthetic_gradients(SIZE, 1, device="cuda")[0]
    k = SIZE // 100
    thc = THCCompressor(rotation="partial", backend="cupy")
    rnd = Round(step=1, world_size=1)
    calls = {
        "topk": lambda: topk_indices(x, k, backend="cupy"),
        "threshold": lambda: threshold_indices(x, 2.0, backend="cupy"),
        "thc": lambda: thc.compress(x, 8.0, rnd),
    }
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                call()
            torch.cuda.synchronize()
        print(f"== {name}, {REPEATS} calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
