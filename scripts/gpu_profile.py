"""Per-kernel CUDA times of the CuPy top-k, threshold and THC paths at 64M elements
(torch.profiler), and the host-side cost of the CuPy plumbing (DLPack views, stream switch).

A diagnostic for scripts/gpu_check.sh: which launch of a composite operation costs what, and how
much of a call's wall time is Python on the host.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from gravac.compressors import Round
from gravac.compressors.thc import THCCompressor
from gravac.kernels import threshold_indices, topk_indices
from gravac_lab.bench.common import synthetic_gradients

SIZE = 64 * 2**20
REPEATS = 5
HOST_CALLS = 1000


def _host_us(call: object, calls: int = HOST_CALLS) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()  # type: ignore[operator]
    return (time.perf_counter() - start) / calls * 1e6


def host_costs(x: torch.Tensor) -> None:
    from gravac.kernels.cupy_runtime import as_cupy, as_cupy_dlpack, torch_stream

    def stream() -> None:
        with torch_stream(x.device):
            pass

    as_cupy(x), as_cupy_dlpack(x)  # CuPy's one-off initialisation is not a per-call cost
    print(f"as_cupy (unowned-memory view) {_host_us(lambda: as_cupy(x)):.1f} us a call")
    print(f"as_cupy_dlpack (cupy.from_dlpack) {_host_us(lambda: as_cupy_dlpack(x)):.1f} us a call")
    print(f"torch_stream enter/exit {_host_us(stream):.1f} us a call")
    print(f"torch.empty(1) on cuda {_host_us(lambda: torch.empty(1, device=x.device)):.1f} us")


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
    host_costs(x)
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        print(f"== {name}: {_host_us(call, 20):.1f} us of host time a call (no sync after)")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(REPEATS):
                call()
            torch.cuda.synchronize()
        print(f"== {name}, {REPEATS} calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
