"""``gravac bench multilevel``: multi-level compression against compressing twice.

Times, for each :class:`gravac.compressors.Multilevel` compressor, compressing at ``cf1`` then
recompressing the result to ``cf2`` (docs/design.md section 7) against compressing the input at
``cf1`` and at ``cf2`` directly; GraVAC (Tyagi and Swany, IEEE CLOUD 2023) reports 1.1x-1.83x
saving. Times, gradient and layout are those of :mod:`gravac_lab.bench.common`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gravac import compressors
from gravac.compressors import Compressor, Context, Multilevel, Payload, Round, check_cf
from gravac.compressors.base import local_stats
from gravac_lab.bench.common import (
    DEFAULT_REPEATS,
    DEFAULT_SEED,
    Instances,
    agreed_round,
    bench_each,
    describe_size,
    environment,
    format_table,
    interleaved_medians,
    json_row,
    model_layout,
    synthetic_gradients,
)

__all__ = [
    "MultilevelResult",
    "bench_multilevel",
    "format_multilevel_table",
    "multilevel_names",
]

#: GraVAC's default theta_min and theta_max (docs/design.md section 9.1).
DEFAULT_CF1 = 10.0
DEFAULT_CF2 = 1000.0


@dataclass(frozen=True)
class MultilevelResult:
    """One row of ``gravac bench multilevel`` (times in seconds).

    ``ratio = direct_s / multilevel_s``: above 1, recompressing is the cheaper way to get both.
    """

    name: str
    size: int
    repeats: int
    cf1: float
    cf2: float
    achieved_cf1: float
    achieved_cf2_multilevel: float
    achieved_cf2_direct: float
    multilevel_s: float
    direct_s: float
    ratio: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats become ``None``)."""
        return json_row(self)


def multilevel_names() -> list[str]:
    """Registered compressors that are :class:`gravac.compressors.Multilevel`."""
    return [n for n in compressors.names() if isinstance(compressors.create(n), Multilevel)]


def bench_multilevel(
    names: Sequence[str] | None = None,
    *,
    size: int,
    cf1: float = DEFAULT_CF1,
    cf2: float = DEFAULT_CF2,
    repeats: int = DEFAULT_REPEATS,
    seed: int = DEFAULT_SEED,
    device: str | torch.device = "cpu",
) -> list[MultilevelResult]:
    """Time compressing at ``cf1`` then recompressing to ``cf2`` against compressing twice.

    Multi-level is ``compress(x, cf1) + recompress(to cf2)``, direct is ``compress(x, cf1) +
    compress(x, cf2)``.

    Each ``compress`` includes its ``local_stats`` (the stats are reduced over the single worker,
    untimed); ``x`` is one synthetic gradient. ``names`` defaults to :func:`multilevel_names`.

    Raises:
        ValueError: ``cf1 >= cf2``, or a named compressor does not support multi-level.
        RuntimeError: a compressor failed; the message names it (the cause is chained).
    """
    check_cf(cf1, name="cf1")
    check_cf(cf2, name="cf2")
    if cf1 >= cf2:
        raise ValueError(f"cf1 must be below cf2 for multi-level compression, got {cf1} >= {cf2}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = multilevel_names() if names is None else list(names)
    unsupported = [n for n in names if not isinstance(compressors.create(n), Multilevel)]
    if unsupported:
        raise ValueError(
            f"compressors {unsupported} do not support multi-level; choose from "
            f"{multilevel_names()}"
        )
    (x,) = synthetic_gradients(size, 1, seed=seed, device=device)
    layout = model_layout(size)
    return bench_each(
        names,
        lambda name: _bench_multilevel_one(name, x, cf1, cf2, repeats, layout),
        failure="multi-level benchmark of {name!r} failed",
    )


def _bench_multilevel_one(
    name: str,
    x: Tensor,
    cf1: float,
    cf2: float,
    repeats: int,
    layout: tuple[torch.Size, ...],
) -> MultilevelResult:
    instances = Instances(name)

    def both_rounds(c: Compressor) -> tuple[Round, Round]:
        return agreed_round(c, [x], cf1, layout), agreed_round(c, [x], cf2, layout)

    rnd1, rnd2 = instances.prime(both_rounds)

    def compress(c: Compressor, cf: float, rnd: Round) -> tuple[Payload, Context]:
        local_stats(c, x, cf, rnd)
        return c.compress(x, cf, rnd)

    def multilevel(c: Compressor) -> tuple[Context, Context]:
        assert isinstance(c, Multilevel)  # checked above
        payload, ctx1 = compress(c, cf1, rnd1)
        return ctx1, c.recompress(payload, ctx1, cf2, rnd2)[1]

    def direct(c: Compressor) -> tuple[Context, Context]:
        return compress(c, cf1, rnd1)[1], compress(c, cf2, rnd2)[1]

    def prepare(run: Callable[[Compressor], object]) -> Callable[[], Callable[[], object]]:
        def prepared() -> Callable[[], object]:
            c = instances.get()
            return lambda: run(c)

        return prepared

    ctx1, ctx2_multi = multilevel(instances.get())
    ctx2_direct = direct(instances.get())[1]
    multilevel_s, direct_s = interleaved_medians(
        [prepare(multilevel), prepare(direct)], repeats=repeats, device=x.device
    )
    return MultilevelResult(
        name=name,
        size=x.numel(),
        repeats=repeats,
        cf1=cf1,
        cf2=cf2,
        achieved_cf1=float(ctx1.achieved_cf),
        achieved_cf2_multilevel=float(ctx2_multi.achieved_cf),
        achieved_cf2_direct=float(ctx2_direct.achieved_cf),
        multilevel_s=multilevel_s,
        direct_s=direct_s,
        ratio=direct_s / multilevel_s if multilevel_s > 0.0 else math.inf,
    )


def format_multilevel_table(
    results: Sequence[MultilevelResult], *, seed: int, device: torch.device
) -> str:
    """The human-readable report of ``gravac bench multilevel``: a header, then a table."""
    if not results:
        return "no registered compressor supports multi-level compression"
    r0 = results[0]
    header = [
        f"gravac bench multilevel: {describe_size(r0.size)}, CF {r0.cf1:g} -> {r0.cf2:g},"
        f" median of {r0.repeats} repeats after one warm-up, seed {seed}, {environment(device)}",
        "  multi-level: compress(x, cf1) + recompress(to cf2); direct: compress(x, cf1) +"
        " compress(x, cf2); each compress includes local_stats",
        "  ratio = direct / multi-level (the GraVAC paper reports 1.1x-1.83x)",
    ]
    headers = ["compressor", "CF1", "CF2 multi", "CF2 direct", "multi ms", "direct ms", "ratio"]
    rows = [
        [
            r.name,
            f"{r.achieved_cf1:.1f}",
            f"{r.achieved_cf2_multilevel:.1f}",
            f"{r.achieved_cf2_direct:.1f}",
            f"{r.multilevel_s * 1e3:.3g}",
            f"{r.direct_s * 1e3:.3g}",
            f"{r.ratio:.2f}",
        ]
        for r in results
    ]
    return "\n".join([*header, "", format_table(headers, rows)])
