"""Deep Gradient Compression (Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression:
Reducing the communication bandwidth for distributed training", ICLR 2018).

DGC sends the ``k = round(d / CF)`` largest-magnitude entries of the accumulated gradient, found
through a threshold estimated on a small sample instead of a full top-k, and keeps the rest
locally. It adds four techniques; this module implements all of them:

* **Sampled threshold selection** (:meth:`DGCCompressor.select`). Sample ``s = max(ceil(rho d),
  _MIN_SAMPLES)`` magnitudes (``rho = sample_ratio``, default 1%) with stride ``floor(d / s)``
  and a random offset drawn from shared seeded randomness (:mod:`gravac.seeding`); the threshold
  is the smallest of the ``ceil(s k / d)`` largest sampled magnitudes, and ``S = {i: |x_i| >=
  thr}``. Adjust loop, at most ``max_adapt_iters`` threshold passes: while ``|S| < k`` the
  threshold is multiplied by ``lower`` (0.8) and ``S`` recomputed (so an overestimate of up to
  ``lower^-(max_adapt_iters - 1)``, 7.5x by default, is recovered); once ``|S| >= k`` the exact
  top-k of ``S`` is sent; a selection above ``upper * k`` (1.3) is DGC's "resample" case and is
  counted in :attr:`DGCCompressor.resamples`. If the loop ends with ``|S| < k`` (or the input is
  not finite), the exact top-k of all values is sent and :attr:`DGCCompressor.fallbacks` is
  incremented.

  .. note:: The paper accepts ``0.8 k <= |S| <= 1.3 k`` elements and truncates; an all-gather of
     fixed-size payloads needs *exactly* k, so any shortfall lowers the threshold and any excess is
     trimmed by an exact top-k of ``S``. Since ``S`` holds every entry at or above the threshold,
     the top-k of ``S`` is the exact top-k of the input (ties aside): the sample only makes the
     selection cheaper (a top-k over about k entries instead of d), never less accurate.

* **Momentum correction** and **momentum factor masking** (:class:`DGCMemory`): momentum is
  accumulated locally *before* sparsification, ``u <- m u + g`` and ``x = e + u`` (``e`` is the
  accumulated residual, the paper's ``v``), and after sending ``e <- x - sent`` and ``u`` is zeroed
  wherever ``sent != 0``, so stale momentum does not keep pushing coordinates that were just
  applied. The wrapped optimizer must therefore be plain SGD **without** momentum (its learning
  rate still applies): otherwise momentum is applied twice.

* **Local gradient clipping** (:class:`DGCMemory`, option ``clip_norm``): each worker clips its
  own gradient to L2 norm ``clip_norm`` before accumulating. The paper derives the per-worker
  threshold from the global one by scaling with ``N^(-1/2)`` for N workers; pass
  ``clip_norm = global_clip / sqrt(N)`` to follow it. The threshold applies to the gradients as
  backward makes them: under a loss scale (``torch.amp.GradScaler``) they are scaled, and so
  clipped at ``clip_norm / S`` in true units.

* **Sparsity warm-up** (option ``warmup_steps``): during the first ``warmup_steps`` steps the CF
  is capped by the schedule 4, 16, 64, 256, 1024 (75%, 93.75%, 98.4%, 99.6%, 99.9% sparsity) in
  five equal stages, in :meth:`~DGCCompressor.compress` and :meth:`~DGCCompressor.recompress`; the
  reported CF is the one achieved. The paper warms up over epochs; here stages count steps.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from gravac.compressors.base import Context, Payload, Round, check_cf
from gravac.compressors.registry import register
from gravac.compressors.sparse import SparseCompressor, SparsePayload
from gravac.kernels import check_backend_name, threshold_indices, topk_indices
from gravac.kernels.sparse import topk_among
from gravac.memory import Memory, Sender
from gravac.seeding import generator

__all__ = ["WARMUP_CFS", "DGCCompressor", "DGCMemory", "clip_to_norm", "warmup_cf_cap"]

#: The paper's sparsity warm-up: CF 4, 16, 64, 256, 1024 (75% ... 99.9% sparsity), one per stage.
WARMUP_CFS: tuple[float, ...] = (4.0, 16.0, 64.0, 256.0, 1024.0)
#: Fewest magnitudes sampled for the threshold, so a small tensor's threshold is not estimated
#: from a handful of values (1% of a 100K-element tensor would be 1000).
_MIN_SAMPLES = 1024
#: Seed tag of the sample offset, separating this stream from other users of (seed, step, key).
_TAG_SAMPLE = 0x444743  # "DGC"
#: Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does (no 0 / 0).
_CLIP_EPS = 1e-6


def _prefix(name: str) -> str:
    return f"dgc option {name}"


def _check_unit_open_closed(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{_prefix(name)} must be in (0, 1], got {value!r}")
    return float(value)


def _check_unit_open(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(f"{_prefix(name)} must be in (0, 1), got {value!r}")
    return float(value)


def _check_int(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{_prefix(name)} must be an int >= {low}, got {value!r}")
    return value


def _check_bool(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{_prefix(name)} must be a bool, got {value!r}")
    return value


def _check_momentum(momentum: float, nesterov: bool) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
        raise ValueError(f"{_prefix('momentum')} must be in [0, 1), got {momentum!r}")
    if _check_bool("nesterov", nesterov) and momentum == 0:
        raise ValueError(f"{_prefix('nesterov')}=True needs momentum in (0, 1), got {momentum!r}")
    return float(momentum)


def _check_clip_norm(clip_norm: float | None) -> float | None:
    if clip_norm is None:
        return None
    if (
        isinstance(clip_norm, bool)
        or not isinstance(clip_norm, int | float)
        or not math.isfinite(clip_norm)
        or clip_norm <= 0
    ):
        raise ValueError(
            f"{_prefix('clip_norm')} must be None or a finite number > 0, got {clip_norm!r}"
        )
    return float(clip_norm)


def warmup_cf_cap(step: int, warmup_steps: int) -> float | None:
    """The CF cap of DGC's sparsity warm-up at ``step``; ``None`` once warm-up is over.

    Stage ``floor(5 step / warmup_steps)`` of the five equal stages caps the CF at
    ``WARMUP_CFS[stage]`` = 4, 16, 64, 256, 1024.
    """
    if step >= warmup_steps:
        return None
    return WARMUP_CFS[step * len(WARMUP_CFS) // warmup_steps]


def clip_to_norm(g: Tensor, max_norm: float, out: Tensor | None = None) -> Tensor:
    """``g * min(1, max_norm / (||g||_2 + eps))`` in ``g``'s dtype (DGC's local clipping),
    written into ``out`` when given (``g`` itself to clip in place).

    The norm is accumulated in at least float32; the result's norm is at most ``max_norm`` up to
    one rounding of ``g``'s dtype. A non-finite norm propagates (NaN or zeros), it is not hidden.
    """
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(g, dtype=acc)
    coef = (max_norm / (norm + _CLIP_EPS)).clamp(max=1.0)
    return torch.mul(g, coef.to(g.dtype), out=out)


def _sum_is_finite(values: Tensor) -> bool:
    """Whether every entry is finite, in one reduction: a NaN or Inf makes the sum non-finite.

    A finite input whose float32 sum overflows is reported non-finite; that only costs the exact
    top-k path, never a wrong result.
    """
    acc = torch.float64 if values.dtype == torch.float64 else torch.float32
    return bool(torch.isfinite(values.sum(dtype=acc)))


class DGCMemory(Memory):
    """DGC's momentum correction, momentum factor masking and local clipping, with error feedback.

    For the gradient ``g`` of bucket ``key``::

        g <- g * min(1, clip_norm / ||g||)      (only if clip_norm is set)
        u <- m u + g                             (momentum, the paper's u)
        x  = e + u          or, Nesterov,  x = e + g + m u
        send C(x)
        e <- x - sent                            (zero where sent: the paper's v masked)
        u[sent != 0] <- 0                        (momentum factor masking)

    The Nesterov form is torch.optim.SGD's; the DGC reference code keeps ``m`` times this ``u``,
    which sends the same ``x``. Masking zeroes ``u`` where the dense ``sent`` is non-zero: an
    entry selected with value exactly 0 carries no update, so keeping its momentum is harmless.
    With ``momentum=0`` this is plain residual error feedback. After a dense step the caller
    either calls ``update(key, x, x)`` (``e = 0``, ``u`` masked wherever ``x != 0``) or
    :meth:`reset`. The new ``u`` is kept only by :meth:`update` (or :meth:`keep`): a step that is
    skipped after :meth:`compensate` (a non-finite value on some rank) leaves the momentum as it
    was. :meth:`settle` computes the new residual and masks the new ``u`` before the send, from a
    sparse payload's kept values (``sent != 0`` where a kept value is not 0), and
    :meth:`compensate_` forms ``x`` in the gradient's own storage, the new ``u`` in the storage
    of the momentum the last commit replaced: a step then holds the old ``u`` and ``e`` and the
    new ``u`` beside the gradient buffer, which becomes the new ``e``.

    Args:
        momentum: ``m`` in [0, 1); the momentum of the SGD this replaces.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        masking: momentum factor masking on (the paper's default) or off.
        clip_norm: local L2 clipping threshold per bucket, or ``None`` for no clipping.
    """

    def __init__(
        self,
        *,
        momentum: float = 0.9,
        nesterov: bool = False,
        masking: bool = True,
        clip_norm: float | None = None,
    ) -> None:
        self.momentum = _check_momentum(momentum, nesterov)
        self.nesterov = nesterov
        self.masking = _check_bool("masking", masking)
        self.clip_norm = _check_clip_norm(clip_norm)
        self.momenta: dict[int, Tensor] = {}
        self.residuals: dict[int, Tensor] = {}
        # momenta computed by compensate() for a step not yet committed by update()
        self._fresh: dict[int, Tensor] = {}
        # per key, the storage of a momentum replaced at commit, for compensate_()'s next one
        self._spare: dict[int, Tensor] = {}

    @staticmethod
    def _check_like(what: str, key: int, state: Tensor, g: Tensor) -> None:
        if state.shape != g.shape or state.dtype != g.dtype:
            raise ValueError(
                f"{what} of bucket {key} has shape {tuple(state.shape)} and dtype {state.dtype}, "
                f"gradient has {tuple(g.shape)} and {g.dtype}"
            )

    def compensate(self, key: int, g: Tensor) -> Tensor:
        if self.clip_norm is not None:
            g = clip_to_norm(g, self.clip_norm)
        u = self._momentum(key, g, None)
        e = self._residual(key, g)
        if self.nesterov:
            x = torch.add(g, u, alpha=self.momentum)
            return x if e is None else x.add_(e)
        return u.clone() if e is None else torch.add(u, e)

    def compensate_(self, key: int, g: Tensor) -> Tensor:
        """:meth:`compensate` with ``x`` in ``g``'s storage (bit for bit the same values)."""
        if self.clip_norm is not None:
            clip_to_norm(g, self.clip_norm, out=g)
        spare = self._spare.pop(key, None)
        if spare is None:  # a skipped step's new momentum is free again
            spare = self._fresh.pop(key, None)
        if spare is not None and (spare.shape != g.shape or spare.dtype != g.dtype):
            spare = None
        u = self._momentum(key, g, spare)
        e = self._residual(key, g)
        if self.nesterov:
            g.add_(u, alpha=self.momentum)
        else:
            g.copy_(u)
        return g if e is None else g.add_(e)

    def _momentum(self, key: int, g: Tensor, out: Tensor | None) -> Tensor:
        """The new ``u = m u + g`` (in ``out`` when given), kept by :meth:`update` or
        :meth:`keep`, dropped if the step is skipped."""
        u = self.momenta.get(key)
        if u is None:
            fresh = g.clone() if out is None else out.copy_(g)
        else:
            self._check_like("momentum", key, u, g)
            fresh = torch.mul(u, self.momentum, out=out).add_(g)
        self._fresh[key] = fresh
        return fresh

    def _residual(self, key: int, g: Tensor) -> Tensor | None:
        e = self.residuals.get(key)
        if e is not None:
            self._check_like("residual", key, e, g)
        return e

    def settle(
        self, key: int, x: Tensor, compressor: Sender, payload: Payload, ctx: Context
    ) -> Tensor | None:
        """``x - D(payload)`` in ``x``'s storage, and the new ``u`` masked where a kept value is
        not 0 (what :meth:`update` masks, ``sent != 0``), before the send; ``None`` for a
        payload that is not sparse (:meth:`update` then runs at commit)."""
        u = self._fresh.get(key)
        if not isinstance(payload, SparsePayload) or u is None:
            return None
        if self.masking:
            nonzero = payload.indices[payload.values != 0]
            u.view(-1).index_fill_(0, nonzero.long(), 0)
        return compressor.residual_(x, payload, ctx)

    def keep(self, key: int, residual: Tensor) -> None:
        """The settled residual and the new (masked) momentum replace the old ones; the old
        momentum's storage is kept for :meth:`compensate_`'s next one."""
        self.swap(key, residual)

    def swap(self, key: int, residual: Tensor) -> Tensor | None:
        old = self.residuals.get(key)
        self.residuals[key] = residual
        u = self._fresh.pop(key, None)
        if u is not None:
            previous = self.momenta.get(key)
            self.momenta[key] = u
            if previous is not None and previous is not u:
                self._spare[key] = previous
        return old if old is not residual else None

    def update(self, key: int, x: Tensor, sent: Tensor) -> None:
        self.residuals[key] = x - sent
        u = self._fresh.pop(key, None)
        if u is None:
            u = self.momenta.get(key)
        else:
            self.momenta[key] = u
        if self.masking and u is not None:
            u.masked_fill_(sent != 0, 0)

    def residual(self, key: int) -> Tensor | None:
        return self.residuals.get(key)

    def reset(self, key: int | None = None) -> None:
        if key is None:
            self.momenta.clear()
            self.residuals.clear()
            self._fresh.clear()
            self._spare.clear()
        else:
            self.momenta.pop(key, None)
            self.residuals.pop(key, None)
            self._fresh.pop(key, None)
            self._spare.pop(key, None)

    def rescale(self, factor: float) -> None:
        """``u <- factor * u`` and ``e <- factor * e`` (:meth:`Memory.rescale`)."""
        for t in (*self.momenta.values(), *self.residuals.values()):
            t.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "momenta": {k: v.clone() for k, v in self.momenta.items()},
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted({"momenta", "residuals"} - set(state))
        if missing:
            raise ValueError(f"DGCMemory state is missing {missing}; got keys {sorted(state)}")
        self.momenta = {int(k): torch.as_tensor(v).clone() for k, v in state["momenta"].items()}
        self.residuals = {int(k): torch.as_tensor(v).clone() for k, v in state["residuals"].items()}

    def __repr__(self) -> str:
        return (
            f"DGCMemory(momentum={self.momentum}, nesterov={self.nesterov}, "
            f"masking={self.masking}, clip_norm={self.clip_norm})"
        )


@register
class DGCCompressor(SparseCompressor):
    """DGC: exactly k entries chosen by a sampled threshold; see the module docstring.

    Args:
        seed: user seed mixed with the step and bucket key for the sample offset.
        sample_ratio: fraction of entries sampled for the threshold, in (0, 1] (paper: 0.01).
        upper: a selection above ``upper * k`` counts as a resample, >= 1 (paper: 1.3).
        lower: threshold multiplier while fewer than k are selected, in (0, 1) (paper: 0.8).
        max_adapt_iters: threshold adjustments before the exact fallback, >= 1 (paper: 10).
        momentum: momentum of the correction in :meth:`make_memory`'s :class:`DGCMemory`.
        nesterov: Nesterov momentum correction.
        momentum_masking: zero the momentum of sent entries (paper: on).
        clip_norm: local gradient clipping threshold per bucket, ``None`` for none.
        warmup_steps: steps of sparsity warm-up (0: none).
        backend: kernel backend (``None`` picks the best available; see :mod:`gravac.kernels`).

    Attributes:
        resamples: selections that exceeded ``upper * k`` before trimming (diagnostics).
        fallbacks: selections that used the exact top-k of all values (diagnostics).
    """

    name: ClassVar[str] = "dgc"

    def __init__(
        self,
        *,
        seed: int = 0,
        sample_ratio: float = 0.01,
        upper: float = 1.3,
        lower: float = 0.8,
        max_adapt_iters: int = 10,
        momentum: float = 0.9,
        nesterov: bool = False,
        momentum_masking: bool = True,
        clip_norm: float | None = None,
        warmup_steps: int = 0,
        backend: str | None = None,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{_prefix('seed')} must be an int, got {seed!r}")
        self.seed = seed
        self.sample_ratio = _check_unit_open_closed("sample_ratio", sample_ratio)
        if (
            isinstance(upper, bool)
            or not isinstance(upper, int | float)
            or not 1 <= upper < math.inf
        ):
            raise ValueError(f"{_prefix('upper')} must be in [1, inf), got {upper!r}")
        self.upper = float(upper)
        self.lower = _check_unit_open("lower", lower)
        self.max_adapt_iters = _check_int("max_adapt_iters", max_adapt_iters, 1)
        self.momentum = _check_momentum(momentum, nesterov)
        self.nesterov = nesterov
        self.momentum_masking = _check_bool("momentum_masking", momentum_masking)
        self.clip_norm = _check_clip_norm(clip_norm)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.backend = check_backend_name(backend)
        self.resamples = 0
        self.fallbacks = 0

    def make_memory(self) -> Memory:
        """A :class:`DGCMemory` with this compressor's momentum, masking and clipping options."""
        return DGCMemory(
            momentum=self.momentum,
            nesterov=self.nesterov,
            masking=self.momentum_masking,
            clip_norm=self.clip_norm,
        )

    def effective_cf(self, cf: float, step: int) -> float:
        """The requested CF, capped by the sparsity warm-up schedule at ``step``."""
        cf = check_cf(cf)
        cap = warmup_cf_cap(step, self.warmup_steps)
        return cf if cap is None else min(cf, cap)

    def compress(self, x: Tensor, cf: float, rnd: Round) -> tuple[SparsePayload, Context]:
        return super().compress(x, self.effective_cf(cf, rnd.step), rnd)

    def recompress(
        self, payload: Payload, ctx: Context, cf: float, rnd: Round
    ) -> tuple[SparsePayload, Context]:
        return super().recompress(payload, ctx, self.effective_cf(cf, rnd.step), rnd)

    def sample_threshold(self, values: Tensor, k: int, rnd: Round) -> float:
        """DGC's threshold estimate: the smallest of the top ``ceil(s k / d)`` of ``s`` samples."""
        d = values.numel()
        s = min(d, max(_MIN_SAMPLES, math.ceil(self.sample_ratio * d)))
        stride = d // s
        gen = generator("cpu", self.seed, rnd.step, rnd.key, _TAG_SAMPLE, d)
        offset = int(torch.randint(stride, (1,), generator=gen))
        sample = values[offset::stride][:s].abs()
        if sample.dtype in (torch.float16, torch.bfloat16):
            sample = sample.float()
        top = min(s, max(1, math.ceil(s * k / d)))
        return float(torch.topk(sample, top, sorted=False).values.min())

    def select(self, values: Tensor, k: int, rnd: Round) -> Tensor:
        if _sum_is_finite(values):
            thr = self.sample_threshold(values, k, rnd)
            for _ in range(self.max_adapt_iters):
                chosen = threshold_indices(values, thr, backend=self.backend)
                n = chosen.numel()
                if n >= k:
                    if n > self.upper * k:
                        self.resamples += 1
                    return topk_among(values, chosen, k, backend=self.backend)
                thr *= self.lower
        # Non-finite input (sent first by the exact top-k) or too few above the lowest threshold.
        self.fallbacks += 1
        return topk_indices(values, k, backend=self.backend)

    def __repr__(self) -> str:
        return (
            f"DGCCompressor(seed={self.seed}, sample_ratio={self.sample_ratio}, "
            f"upper={self.upper}, lower={self.lower}, max_adapt_iters={self.max_adapt_iters}, "
            f"momentum={self.momentum}, nesterov={self.nesterov}, "
            f"momentum_masking={self.momentum_masking}, clip_norm={self.clip_norm}, "
            f"warmup_steps={self.warmup_steps}, backend={self.backend!r})"
        )
