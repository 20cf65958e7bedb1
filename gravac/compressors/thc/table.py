"""THC's optimal lookup table T_{b,g,p} by an exact dynamic program (docs/design.md section 10).

THC (Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor Homomorphic
Compression", NSDI 2024, section 5.3) quantises each rotated, normalised coordinate
``A ~ N(0, 1)``, clamped to ``[-t_p, t_p]`` with ``t_p = Phi^-1(1 - p/2)`` (a fraction ``p`` of the
coordinates is clamped), after mapping it linearly onto ``[0, g]``::

    x = (A + t_p) * alpha,    alpha = g / (2 t_p)

onto ``2^b`` integer levels ``0 = T[0] < T[1] < ... < T[2^b - 1] = g`` by stochastic rounding
between adjacent levels. Rounding ``x`` in ``[a, c]`` up with probability ``(x - a) / (c - a)`` is
unbiased with variance ``(c - x)(x - a)``, so the expected error of the table is a sum over
consecutive levels::

    E(T) = sum_z cost(T[z], T[z+1]),  cost(a, c) = E[(c - x)(x - a); a <= x <= c | |A| <= t_p]

and the optimal table is a shortest path with exactly ``2^b - 1`` edges from level 0 to level g:
a dynamic program over integer levels, ``O(2^b g^2)``. The paper solves the same problem with a
specialised ILP solver (its Appendix B); the exact DP here makes the tables reproducible instead
of shipped. The clamped coordinates land exactly on the levels 0 and g and add no rounding error.

``cost`` is in closed form: with ``u, v`` the ends of ``[a, c]`` in ``A`` units,
``M0 = Phi(v) - Phi(u)``, ``M1 = phi(u) - phi(v)`` and ``M2 = M0 + u phi(u) - v phi(v)`` (the
zeroth, first and second moments of the standard normal over ``[u, v]``)::

    cost(a, c) = alpha^2 (-M2 + (u + v) M1 - u v M0) / (1 - p)

Everything is float64 on the CPU and cached per ``(b, g, p)``.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from statistics import NormalDist

import torch

__all__ = [
    "VALID_BITS",
    "brute_force_table",
    "clamp_error",
    "clamp_threshold",
    "expected_nmse",
    "interval_costs",
    "optimal_table",
    "table_objective",
]

#: Bit widths the THC compressor supports: b-bit indices pack whole bytes (8 / b per byte).
#: The table functions accept any width up to :data:`_MAX_TABLE_BITS` (tests use b = 3).
VALID_BITS = (1, 2, 4, 8)
#: Widest table the DP builds: 2^8 levels; the DP is O(2^b g^2).
_MAX_TABLE_BITS = 8

_STD_NORMAL = NormalDist()
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check(bits: int, granularity: int, p: float) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= _MAX_TABLE_BITS:
        raise ValueError(f"bits must be an int in [1, {_MAX_TABLE_BITS}], got {bits!r}")
    if isinstance(granularity, bool) or not isinstance(granularity, int):
        raise ValueError(f"granularity must be an int >= 2^bits - 1, got {granularity!r}")
    if granularity < 2**bits - 1:
        raise ValueError(
            f"granularity must be >= 2^bits - 1 = {2**bits - 1} for bits={bits}, got {granularity}"
        )
    if not isinstance(p, int | float) or not 0.0 < p < 1.0:
        raise ValueError(f"p (the clamped fraction) must be in (0, 1), got {p!r}")


def clamp_threshold(p: float) -> float:
    """``t_p = Phi^-1(1 - p/2)``: a fraction ``p`` of N(0, 1) lies outside ``[-t_p, t_p]``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p (the clamped fraction) must be in (0, 1), got {p!r}")
    return _STD_NORMAL.inv_cdf(1.0 - p / 2.0)


def clamp_error(p: float) -> float:
    """Mean squared clamping error of N(0, 1) at ``+-t_p``: ``E[(|A| - t_p)^2; |A| > t_p]``.

    ``= 2 [(1 + t^2)(1 - Phi(t)) - t phi(t)]``: the bias THC leaves to error feedback.
    """
    t = clamp_threshold(p)
    tail = 1.0 - _STD_NORMAL.cdf(t)
    return 2.0 * ((1.0 + t * t) * tail - t * _STD_NORMAL.pdf(t))


def interval_costs(granularity: int, p: float) -> torch.Tensor:
    """``(g+1, g+1)`` float64 matrix: ``cost[a, c]`` (module docstring) for ``a < c``, else inf.

    In squared level units, per coordinate of the truncated normal.
    """
    g = granularity
    t = clamp_threshold(p)
    alpha = g / (2.0 * t)
    u = [j / alpha - t for j in range(g + 1)]
    cdf = torch.tensor([_STD_NORMAL.cdf(v) for v in u], dtype=torch.float64)
    pdf = torch.tensor([_INV_SQRT_2PI * math.exp(-0.5 * v * v) for v in u], dtype=torch.float64)
    ut = torch.tensor(u, dtype=torch.float64)
    lo_u, hi_u = ut[:, None], ut[None, :]
    m0 = cdf[None, :] - cdf[:, None]
    m1 = pdf[:, None] - pdf[None, :]
    m2 = m0 + lo_u * pdf[:, None] - hi_u * pdf[None, :]
    cost = (-m2 + (lo_u + hi_u) * m1 - lo_u * hi_u * m0) * (alpha * alpha / (1.0 - p))
    # The closed form cancels terms of similar size; clip the rounding below zero away.
    cost = cost.clamp(min=0.0)
    upper = torch.ones(g + 1, g + 1, dtype=torch.bool).triu(diagonal=1)
    return cost.masked_fill(~upper, math.inf)


def table_objective(levels: tuple[int, ...] | list[int], granularity: int, p: float) -> float:
    """Expected rounding error ``E(T)`` (squared level units) of the sorted table ``levels``."""
    cost = interval_costs(granularity, p)
    return float(sum(cost[a, c] for a, c in itertools.pairwise(levels)))


def _shortest_chain(cost: torch.Tensor, edges: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Least cost of a strictly increasing chain of ``edges`` steps from level 0 to each level.

    ``best[j] = min_i best_prev[i] + cost[i, j]``, ``edges`` times; returns the final ``best`` and
    the argmin of every round (ties go to the lowest predecessor) for backtracking.
    """
    best = torch.full((cost.shape[0],), math.inf, dtype=torch.float64)
    best[0] = 0.0
    back = []
    for _ in range(edges):
        total = best[:, None] + cost  # total[i, j]: the chain ending at i, then i -> j
        best, arg = total.min(dim=0)
        back.append(arg)
    return best, back


def _backtrack(back: list[torch.Tensor], last: int) -> list[int]:
    levels = [last]
    for arg in reversed(back):
        levels.append(int(arg[levels[-1]]))
    levels.reverse()
    return levels


@lru_cache(maxsize=64)
def optimal_table(
    bits: int, granularity: int, p: float, *, symmetric: bool = False
) -> tuple[int, ...]:
    """The optimal table ``T_{b,g,p}``: ``2^b`` sorted integer levels from 0 to g.

    Exact dynamic program: ``best[k][j]`` is the least error of ``k + 1`` levels from 0 ending at
    ``j``; ``best[k][j] = min_{i < j} best[k-1][i] + cost[i, j]``; the table is the path to
    ``best[2^b - 1][g]``.

    With ``symmetric=True`` the table is restricted to mirror-symmetric ones,
    ``T[z] + T[2^b - 1 - z] = g``: the DP runs over the lower half with the cost of each interval
    plus that of its mirror image, and closes with the middle interval ``[m, g - m]``. THC's
    published table for (4, 30, 1/32), ``0 3 5 7 9 11 13 14 16 17 19 21 23 25 27 30``, is exactly
    this symmetric optimum; the unrestricted optimum (``... 13 15 16 17 ...``) has 0.09% less
    rounding error.

    Raises:
        ValueError: ``bits`` not an int in [1, 8], ``granularity < 2^bits - 1``, ``p`` not in
            (0, 1).
    """
    _check(bits, granularity, p)
    g = granularity
    n_levels = 2**bits
    cost = interval_costs(g, p)
    if not symmetric:
        _, back = _shortest_chain(cost, n_levels - 1)
        levels = _backtrack(back, g)
    else:
        # Lower half: n_levels / 2 levels from 0 to m < g - m; each interval counts twice.
        mirrored = cost + cost.flip(0, 1).t()  # cost[a, c] + cost[g - c, g - a]
        half, back = _shortest_chain(mirrored, n_levels // 2 - 1)
        idx = torch.arange(g + 1)
        middle = cost[idx, (g - idx).clamp(min=0)]  # cost[m, g - m], inf unless m < g - m
        m = int(torch.argmin(half + middle))
        lower = _backtrack(back, m)
        levels = lower + [g - v for v in reversed(lower)]
    if levels[0] != 0 or levels[-1] != g or len(set(levels)) != n_levels:
        raise RuntimeError(f"table DP failed for bits={bits}, g={g}, p={p}: {levels}")
    return tuple(levels)


def brute_force_table(
    bits: int, granularity: int, p: float, *, symmetric: bool = False
) -> tuple[int, ...]:
    """Reference for tests: the best table over every choice of inner levels (small g only)."""
    _check(bits, granularity, p)
    g = granularity
    cost = interval_costs(g, p).tolist()
    best_err, best_levels = math.inf, ()
    for inner in itertools.combinations(range(1, g), 2**bits - 2):
        levels = (0, *inner, g)
        if symmetric and any(a + c != g for a, c in zip(levels, reversed(levels), strict=True)):
            continue
        err = sum(cost[a][c] for a, c in itertools.pairwise(levels))
        if err < best_err:
            best_err, best_levels = err, levels
    return best_levels


def expected_nmse(bits: int, granularity: int, p: float, *, symmetric: bool = False) -> float:
    """Predicted per-coordinate MSE of one worker for N(0, 1) coordinates (the NMSE after RHT).

    Rounding error of the optimal table in ``A`` units, ``(1 - p) E(T) / alpha^2``, plus the
    clamping error :func:`clamp_error`. Used to choose the default granularity per bit width.
    """
    levels = optimal_table(bits, granularity, p, symmetric=symmetric)
    alpha = granularity / (2.0 * clamp_threshold(p))
    rounding = (1.0 - p) * table_objective(levels, granularity, p) / (alpha * alpha)
    return rounding + clamp_error(p)
