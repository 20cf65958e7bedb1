"""Per-step records of what the optimizer did, and a TensorBoard monitor for them.

Tags written (``gravac/...``): ``cf_sent`` (the CF the controller chose), ``cf_achieved`` (what
the compressor achieved over the compressed buckets: 2 for fp16 whatever was asked),
``cf_candidate``, ``theta_min``, ``gain_min``, ``gain_candidate`` (smoothed gains),
``gain_min_step``, ``gain_candidate_step`` (this step's), ``system_throughput``,
``compression_throughput``, ``wire_bytes``, ``dense_wire_bytes``, ``compress_seconds``,
``comm_seconds``. The optimizer calls a monitor on rank 0 only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Monitor", "StepRecord", "TensorBoardMonitor"]


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did (values agreed by all ranks, timings of this rank)."""

    step: int
    phase: str
    cf_sent: float
    cf_achieved: float
    sent: str
    theta_min: float
    cf_candidate: float | None
    gain_min: float | None
    gain_candidate: float | None
    gain_min_step: float
    gain_candidate_step: float | None
    system_throughput: float | None
    compression_throughput: float | None
    wire_bytes: int
    dense_wire_bytes: int
    compress_seconds: float
    comm_seconds: float
    skipped: bool = False

    def scalars(self) -> dict[str, float]:
        """The numeric fields that are set, by tag name."""
        out: dict[str, float] = {}
        for name in (
            "cf_sent",
            "cf_achieved",
            "theta_min",
            "cf_candidate",
            "gain_min",
            "gain_candidate",
            "gain_min_step",
            "gain_candidate_step",
            "system_throughput",
            "compression_throughput",
            "wire_bytes",
            "dense_wire_bytes",
            "compress_seconds",
            "comm_seconds",
        ):
            value = getattr(self, name)
            if value is not None and math.isfinite(float(value)):
                out[name] = float(value)
        return out


class Monitor(Protocol):
    """Anything that takes step records."""

    def log(self, record: StepRecord) -> None:
        """Record one step."""

    def close(self) -> None:
        """Flush and release resources."""


class TensorBoardMonitor:
    """Writes every :class:`StepRecord` as TensorBoard scalars under ``gravac/``.

    Args:
        log_dir: directory of the event file, or an existing ``SummaryWriter`` to write to
            (which is then not closed by :meth:`close`).
        flush_every: steps between flushes of the event file.
    """

    def __init__(self, log_dir: Any, *, flush_every: int = 50) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self._owned = not isinstance(log_dir, SummaryWriter)
        self.writer = SummaryWriter(log_dir=str(log_dir)) if self._owned else log_dir
        self.flush_every = flush_every

    def log(self, record: StepRecord) -> None:
        for tag, value in record.scalars().items():
            self.writer.add_scalar(f"gravac/{tag}", value, record.step)
        if record.step % self.flush_every == 0:
            self.writer.flush()

    def close(self) -> None:
        self.writer.flush()
        if self._owned:
            self.writer.close()
