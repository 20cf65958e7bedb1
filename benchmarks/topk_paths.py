"""Which exact top-k is fastest on the CPU, by size: what :func:`gravac.kernels.sparse.topk_indices`
chooses against ``torch.topk`` and NumPy's ``argpartition``, in the same run.

``topk_indices`` takes the sampled threshold path from ``_THRESHOLD_MIN_NUMEL`` elements on (for
``k`` up to 1/8 of them), ``argpartition`` from ``_PARTITION_MIN_NUMEL`` where the threshold
declines, and ``torch.topk`` below both. The search by shadow selects over samples of 1/64 of a
bucket at every CF of its ladder at every step, so the small sizes are on its hot path. Prints, per
size and ``k = n / cf``, the median microseconds of each and ``chosen / best``: the chosen path's
time over the faster of the other two (at most about 1 where the dispatch is right)::

    python benchmarks/topk_paths.py                     # 1 thread, sizes 2K to 1M
    python benchmarks/topk_paths.py --sizes 4096,65536 --cfs 10,1000
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from gravac.kernels.sparse import topk_indices, topk_indices_reference
from gravac_lab.bench.common import format_table, interleaved_medians

#: the default sizes: the shadow samples of the scoreboard's models (41K-83K elements for the
#: VGG-style CNN) and a decade either side
SIZES = (2048, 8192, 16384, 32768, 49152, 65536, 262144, 1048576)
#: the default CFs: the exponential ladder's ends and middle, and one past the threshold's 1/8
CFS = (4, 10, 40, 160, 1000)


def _argpartition(x: torch.Tensor, k: int) -> Callable[[], object]:
    xn = x.numpy()
    return lambda: np.argpartition(np.abs(xn), xn.size - k)[xn.size - k :]


def row(n: int, cf: float, repeats: int) -> list[str]:
    """One table row: the three medians (us) and chosen / best of the other two."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    k = max(1, round(n / cf))
    cases = [
        lambda: lambda: topk_indices(x, k, backend="torch"),
        lambda: lambda: topk_indices_reference(x, k),
        lambda: _argpartition(x, k),
    ]
    chosen, reference, partition = interleaved_medians(
        cases, repeats=repeats, device=torch.device("cpu")
    )
    best = min(reference, partition)
    cells = [f"{s * 1e6:.0f}" for s in (chosen, reference, partition)]
    return [str(n), f"{cf:g}", str(k), *cells, f"{chosen / best:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated")
    parser.add_argument("--cfs", default=",".join(map(str, CFS)), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=101, help="timed repeats (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [
        row(int(n), float(cf), args.repeats)
        for n in args.sizes.split(",")
        for cf in args.cfs.split(",")
    ]
    print(f"top-k on the CPU, float32, {args.threads} thread(s), median of {args.repeats}")
    headers = ["n", "cf", "k", "chosen us", "torch.topk us", "argpartition us", "chosen/best"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
