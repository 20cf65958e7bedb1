"""What gravac costs a model of many small parameters, against plain SGD in the same run.

One process (no process group): a model of ``--params`` parameters of ``--shape`` each, trained
for ``--steps`` steps by plain ``torch.optim.SGD`` and by :class:`gravac.GravacOptimizer` around
the same SGD. Prints the seconds of the first step (where gravac builds its layout), the median
of the later steps, and ``state_dict()``, each beside plain SGD's and as a ratio::

    python benchmarks/many_params.py --params 10000           # the default search (Top-k)
    python benchmarks/many_params.py --params 10000 --cf 4    # a static CF
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import gravac


def _model(params: int, shape: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    return nn.ParameterList(nn.Parameter(torch.randn(*shape)) for _ in range(params))


def _loss(model: nn.Module) -> torch.Tensor:
    return torch.stack([p.square().sum() for p in model.parameters()]).sum()


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _run(
    params: int, shape: tuple[int, ...], steps: int, options: dict[str, object] | None
) -> dict[str, float]:
    """Seconds of the first step, the median later step and ``state_dict()``; ``options``:
    GravacOptimizer's (``None``: plain SGD)."""
    model = _model(params, shape)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if options is not None:
        opt = gravac.GravacOptimizer(opt, **options)  # type: ignore[arg-type]

    def step() -> None:
        opt.zero_grad()
        _loss(model).backward()
        opt.step()

    first = _seconds(step)
    later = [_seconds(step) for _ in range(steps - 1)]
    saving = _seconds(opt.state_dict)
    return {"first": first, "step": statistics.median(later), "state_dict": saving}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=10_000)
    parser.add_argument("--shape", default="4,4", help="each parameter's shape, comma-separated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cf", type=float, default=None, help="a static CF (default: the search)")
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    torch.set_num_threads(1)
    static = {"policy": "fixed", "policy_options": {"cf": args.cf}}
    options: dict[str, object] = {} if args.cf is None else static
    plain = _run(args.params, shape, args.steps, None)
    ours = _run(args.params, shape, args.steps, options)
    what = "the default search" if args.cf is None else f"static CF {args.cf:g}"
    print(f"{args.params} parameters of shape {shape}, {args.steps} steps, one process, {what}")
    print(f"{'':12} {'SGD s':>10} {'gravac s':>10} {'ratio':>8}")
    for key in ("first", "step", "state_dict"):
        ratio = ours[key] / plain[key] if plain[key] > 0 else float("inf")
        print(f"{key:12} {plain[key]:10.3f} {ours[key]:10.3f} {ratio:8.1f}")


if __name__ == "__main__":
    main()
