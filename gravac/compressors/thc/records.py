"""The records of one THC round (docs/design.md section 10).

What every rank encodes with (:class:`Encoding`, all agreed or shared), what travels
(:class:`THCLevelsPayload` on the all-reduce, :class:`THCPackedPayload` on the all-gather) and
what the sender keeps to decode (:class:`THCContext`): the payload apart from the context, as in
GRACE. Every THC tensor is rotated and quantised in the compute dtype (:func:`_compute_dtype`):
float64 stays float64, everything else is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gravac.compressors.base import Context, Payload
from gravac.kernels.quantize import hash_signs

__all__ = ["Encoding", "THCContext", "THCLevelsPayload", "THCPackedPayload"]


@dataclass(frozen=True)
class THCLevelsPayload(Payload):
    """All-reduce transport: table levels packed in lanes of int64 words, and the contributions.

    Attributes:
        words: :func:`.pack_lanes` of ``T[z]`` in ``0..g`` per padded element, in lanes of
            :func:`.lane_bits` bits (summed: ``0..g * N`` per lane).
        count: one int64 element, 1 per rank (summed: ``N``); empty for an empty input.
    """

    words: Tensor
    count: Tensor


@dataclass(frozen=True)
class THCPackedPayload(Payload):
    """All-gather transport: the ``b``-bit table indices, ``8 / b`` per byte (uint8)."""

    indices: Tensor


@dataclass(frozen=True)
class Encoding:
    """What every rank encodes one THC round with (all agreed or shared).

    Attributes:
        granularity: ``g``, levels are integers in ``0..g``.
        clamp: ``t_p``.
        block: rotation block length ``B`` (the padded length for the full rotation).
        padded: padded length, a multiple of ``block``.
        sign_seed: seed of the Rademacher diagonal.
        round_seed: seed of the rounding hash.
        bits: ``b``, bits per index.
    """

    granularity: int
    clamp: float
    block: int
    padded: int
    sign_seed: int
    round_seed: int
    bits: int


@dataclass(frozen=True)
class THCContext(Context):
    """What the sender keeps to decompress (identical on every rank).

    Attributes:
        bits: ``b``, bits per index.
        granularity: ``g``, levels are integers in ``0..g``.
        clamp: ``t_p``.
        table: the ``2^b`` levels ``T_{b,g,p}`` (int64, on the CPU).
        norms: agreed max-norm per block (float, one per rotated block).
        sign_seed: seed of the Rademacher diagonal (:attr:`signs`).
        device: where the payload lives.
        block: rotation block length ``B`` (the padded length for the full rotation).
        padded: padded length, a multiple of ``block``.
        world_size: ranks the all-reduce lanes were sized for.
        lane_bits: width of the all-reduce's lanes (0 for the all-gather).
        round_seed: seed of the rounding hash (:func:`.thc_payload` reproduces the payload).
    """

    bits: int
    granularity: int
    clamp: float
    table: Tensor
    norms: Tensor
    sign_seed: int
    device: torch.device
    block: int
    padded: int
    world_size: int
    lane_bits: int
    round_seed: int

    @property
    def encoding(self) -> Encoding:
        """What the payload was encoded with (:func:`.thc_payload` reproduces it)."""
        return Encoding(
            self.granularity, self.clamp, self.block, self.padded, self.sign_seed,
            self.round_seed, self.bits,
        )  # fmt: skip

    @property
    def signs(self) -> Tensor:
        """The Rademacher diagonal over the padded length, in the compute dtype."""
        cd = _compute_dtype(self.dtype)
        return hash_signs(self.padded, self.sign_seed, dtype=cd, device=self.device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other dtype is rotated and quantised in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
