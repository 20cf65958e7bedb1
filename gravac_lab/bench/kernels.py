"""``gravac bench kernels``: each CuPy kernel against its torch path and a plain copy, on a GPU.

For every kernel, on the same synthetic float32 gradient of ``size`` elements (one worker's, see
:func:`gravac_lab.bench.common.synthetic_gradients`): the median time of the torch path, of the CuPy
path, and of ``dst.copy_(src)`` of the float32 input into a preallocated buffer, all synchronised
and interleaved in the same loop (:func:`gravac_lab.bench.common.interleaved_medians`). Reported:
``speedup = torch / cupy`` and ``of copy = copy / cupy``, the kernel's input throughput as a
fraction of the device's copy throughput (1.0: as fast as copying the gradient once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gravac.compressors.thc import Encoding, THCCompressor, block_norms, thc_payload
from gravac.compressors.thc.table import clamp_threshold
from gravac.kernels import (
    available_backends,
    pack_bits,
    scaled_cast,
    scatter_add,
    threshold_indices,
    topk_indices,
    unpack_lookup_sum,
)
from gravac_lab.bench.common import (
    DEFAULT_REPEATS,
    DEFAULT_SEED,
    describe_size,
    environment,
    format_table,
    interleaved_medians,
    json_row,
    synthetic_gradients,
)

__all__ = ["KERNELS", "KernelResult", "bench_kernels", "format_kernel_table"]

#: Top-k keeps 1% (CF 100), the sparsifiers' usual operating point.
TOPK_CF = 100
#: Workers whose sparse payloads are scatter-added, and whose packed THC payloads are summed.
WORKERS = 2
#: THC at 4 bits (CF 8), its paper's default.
THC_BITS = 4
THC_CF = 8
_SEED_A, _SEED_B = 0x5EED, 0xB0B


@dataclass(frozen=True)
class KernelResult:
    """Medians of one kernel (seconds)."""

    kernel: str
    size: int
    repeats: int
    torch_s: float
    cupy_s: float
    copy_s: float

    @property
    def speedup(self) -> float:
        """Torch path time over CuPy path time."""
        return self.torch_s / self.cupy_s

    @property
    def of_copy(self) -> float:
        """CuPy throughput as a fraction of the copy's: copy time over kernel time."""
        return self.copy_s / self.cupy_s

    def to_json(self) -> dict[str, Any]:
        return {**json_row(self), "speedup": self.speedup, "of_copy": self.of_copy}


Case = Callable[[str], Callable[[], object]]


def _thc(partial: bool) -> THCCompressor:
    return THCCompressor(bits=THC_BITS, rotation="partial" if partial else "full")


def _thc_case(x: Tensor, *, partial: bool, packed: bool) -> Case:
    thc = _thc(partial)
    block, padded = thc.layout(x.numel())
    _, g, p = thc.config(float(THC_CF))
    table = torch.tensor(thc.table(float(THC_CF)))
    norms = block_norms(x, block, padded)
    enc = Encoding(g, clamp_threshold(p), block, padded, _SEED_A, _SEED_B, THC_BITS)
    lane = None if packed else torch.uint8
    return lambda backend: lambda: thc_payload(x, norms, table, enc, lane=lane, backend=backend)


def _cases(grads: Sequence[Tensor]) -> dict[str, Case]:
    x = grads[0]
    n = x.numel()
    k = max(1, n // TOPK_CF)
    picks = [topk_indices(g, k, backend="torch") for g in grads[:WORKERS]]
    threshold = float(x[picks[0]].abs().min())  # keeps the same 1% as top-k
    indices = torch.cat(picks)
    values = torch.cat([g[i] for g, i in zip(grads, picks, strict=False)])
    table = torch.tensor(_thc(partial=True).table(float(THC_CF)))
    gen = torch.Generator(device=x.device).manual_seed(0)
    packed = [
        pack_bits(torch.randint(0, 2**THC_BITS, (n,), generator=gen, device=x.device), THC_BITS)
        for _ in range(WORKERS)
    ]
    return {
        "topk (CF 100)": lambda b: lambda: topk_indices(x, k, backend=b),
        "threshold (1%)": lambda b: lambda: threshold_indices(x, threshold, backend=b),
        f"scatter_add ({WORKERS} x CF 100)": lambda b: (
            lambda: scatter_add(n, indices, values, backend=b)
        ),
        "fp16 scaled cast": lambda b: lambda: scaled_cast(x, torch.float16, divisor=2, backend=b),
        "bf16 scaled cast": lambda b: lambda: scaled_cast(x, torch.bfloat16, divisor=2, backend=b),
        "thc partial, levels": _thc_case(x, partial=True, packed=False),
        "thc partial, packed": _thc_case(x, partial=True, packed=True),
        "thc full, levels": _thc_case(x, partial=False, packed=False),
        f"thc unpack+sum ({WORKERS})": lambda b: (
            lambda: unpack_lookup_sum(packed, THC_BITS, n, table, backend=b)
        ),
    }


#: The benchmarked kernels, in report order.
KERNELS = (
    "topk (CF 100)",
    "threshold (1%)",
    f"scatter_add ({WORKERS} x CF 100)",
    "fp16 scaled cast",
    "bf16 scaled cast",
    "thc partial, levels",
    "thc partial, packed",
    "thc full, levels",
    f"thc unpack+sum ({WORKERS})",
)


def bench_kernels(
    *,
    size: int,
    repeats: int = DEFAULT_REPEATS,
    seed: int = DEFAULT_SEED,
    device: str | torch.device = "cuda",
) -> list[KernelResult]:
    """Time every kernel of :data:`KERNELS` on ``device``.

    Raises:
        ValueError: ``device`` is not a CUDA device, or CuPy is not installed.
    """
    device = torch.device(device)
    if device.type != "cuda" or "cupy" not in available_backends():
        raise ValueError(
            f"gravac bench kernels needs a CUDA --device and CuPy (pip install 'gravac[cuda]'), "
            f"got --device {device} with backends {available_backends()}"
        )
    grads = synthetic_gradients(size, WORKERS, seed=seed, device=device)
    src = grads[0]
    dst = torch.empty_like(src)
    cases = _cases(grads)
    results = []
    for name in KERNELS:
        case = cases[name]
        torch_s, cupy_s, copy_s = interleaved_medians(
            [partial(case, "torch"), partial(case, "cupy"), lambda: partial(dst.copy_, src)],
            repeats=repeats,
            device=device,
        )
        results.append(KernelResult(name, size, repeats, torch_s, cupy_s, copy_s))
    return results


def format_kernel_table(results: Sequence[KernelResult], *, seed: int, device: torch.device) -> str:
    """The human-readable report of ``gravac bench kernels``."""
    r0 = results[0]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    header = [
        f"gravac bench kernels: {describe_size(r0.size)}, {name}, median of {r0.repeats} "
        f"repeats after one warm-up, seed {seed}, {environment(device)}",
        "  speedup: torch path time / CuPy time;  of copy: time of dst.copy_(src) of the "
        "float32 input / CuPy time (1.0 = as fast as one copy of the gradient)",
    ]
    headers = ["kernel", "torch ms", "cupy ms", "copy ms", "speedup", "of copy"]
    rows = [
        [
            r.kernel,
            f"{r.torch_s * 1e3:.3f}",
            f"{r.cupy_s * 1e3:.3f}",
            f"{r.copy_s * 1e3:.3f}",
            f"{r.speedup:.2f}",
            f"{r.of_copy:.2f}",
        ]
        for r in results
    ]
    return "\n".join([*header, "", format_table(headers, rows)])
