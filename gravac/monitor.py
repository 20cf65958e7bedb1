"""Per-step records of what the optimizer did, and a TensorBoard monitor for them.

Tags written (``gravac/...``) are described in :data:`TAG_DESCRIPTIONS`, which the monitor also
writes once as a text summary (``gravac/tags``) so that the descriptions travel with the logs.
The optimizer calls a monitor on rank 0 only; a skipped step is recorded too (``skipped_steps``
and ``phase`` only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "PHASE_CODES",
    "SENT_CODES",
    "TAG_DESCRIPTIONS",
    "Monitor",
    "StepRecord",
    "TensorBoardMonitor",
]

#: Numeric codes of what was sent and of the controller's phase (scalars must be numbers).
SENT_CODES = {"dense": 0, "min": 1, "candidate": 2}
PHASE_CODES = {"warmup": 0, "search": 1, "settled": 2, "fixed": 3, "accordion": 4}

#: Every tag, and what it holds.
TAG_DESCRIPTIONS: dict[str, str] = {
    "cf_sent": "the CF the controller chose to send (1 for dense)",
    "cf_achieved": "the CF the compressor delivered over the compressed buckets (fp16: 2)",
    "sent": "what was sent: 0 dense, 1 the theta_min compression, 2 the candidate's",
    "phase": "controller phase: 0 warm-up, 1 search, 2 settled, 3 fixed CF, 4 Accordion",
    "theta_min": "the lowest CF sent compressed",
    "cf_candidate": "the candidate CF evaluated this step (Algorithm 1, search='paper', only: "
    "the other searches compress at one CF a step)",
    "gain_min": "smoothed compression gain at theta_min (the CF sent under the searches by "
    "trial and shadow)",
    "gain_candidate": "smoothed compression gain at the candidate CF (search='paper' only)",
    "gain_min_step": "this step's gain at theta_min (agreed across ranks)",
    "gain_candidate_step": "this step's gain at the candidate CF (search='paper' only)",
    "gain_window": "the gain error feedback delivered over the window that ended before this "
    "step, at the CF it sent (gravac.control.window; logged once a window)",
    "gain_shadow/cf<CF>": "the window gain of <CF> over the same window, by error feedback "
    "replayed on a sample without sending it (gravac.control.replay; the search by shadow)",
    "gain_judged/cf<CF>": "the gain the search by shadow judged <CF> by when it chose the next "
    "window's CF at this step: the shadow gain less its excess, its held-back part counted by the "
    "signal share (gravac.control.searches.shadow; logged once a window)",
    "tsys_estimated/cf<CF>": "the samples/s the search by shadow estimated for <CF> at the same "
    "choice: measured where <CF> was sent, else from the CFs timed around it or the link model",
    "signal": "the signal share of the window's gradient that ended before this step, from how "
    "the ranks' window sums agree (gravac.control.noise; the search by shadow, 2 ranks or more)",
    "system_throughput": "smoothed samples/s measured while sending at cf_sent",
    "compression_throughput": "gain x system throughput at cf_sent (what the search maximises)",
    "wire_bytes": "bytes this rank sent this step",
    "dense_wire_bytes": "bytes a dense float32 all-reduce would have sent this step",
    "bytes_saved": "cumulative dense bytes minus wire bytes since the start",
    "compress_seconds": "seconds compensating and compressing this step, much of it "
    "overlapped with backward (this rank)",
    "comm_seconds": "seconds from the last bucket's launch until every aggregate had arrived: "
    "the communication not hidden behind backward (this rank)",
    "skipped_steps": "cumulative steps skipped for a non-finite gradient or aggregate",
}


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
    gain_window: float | None = None
    gain_shadow: tuple[tuple[float, float], ...] = ()  # (CF, window gain) of the shadows
    signal: float | None = None
    bytes_saved: int = 0
    skipped_steps: int = 0
    # (CF, judged gain, estimated samples/s) the search by shadow chose by at this step
    judged: tuple[tuple[float, float, float], ...] = ()

    @classmethod
    def skip(cls, step: int, phase: str, skipped_steps: int) -> StepRecord:
        """The record of a skipped step: its phase and the running count of skips only."""
        nan = math.nan
        return cls(
            step, phase, nan, nan, "skipped", nan, None, None, None, nan, None, None, None,
            0, 0, nan, nan, skipped=True, skipped_steps=skipped_steps,
        )  # fmt: skip

    def scalars(self) -> dict[str, float]:
        """The numeric fields that are set, by tag name."""
        out: dict[str, float] = {"phase": float(PHASE_CODES[self.phase])}
        out["skipped_steps"] = float(self.skipped_steps)
        if self.skipped:
            return out
        out["sent"] = float(SENT_CODES[self.sent])
        out["bytes_saved"] = float(self.bytes_saved)
        for name in (
            "cf_sent",
            "cf_achieved",
            "theta_min",
            "cf_candidate",
            "gain_min",
            "gain_candidate",
            "gain_min_step",
            "gain_candidate_step",
            "gain_window",
            "signal",
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
        for cf, gain in self.gain_shadow:
            if math.isfinite(gain):
                out[f"gain_shadow/cf{cf:g}"] = gain
        for cf, gain, tsys in self.judged:
            if math.isfinite(gain):
                out[f"gain_judged/cf{cf:g}"] = gain
            if math.isfinite(tsys):
                out[f"tsys_estimated/cf{cf:g}"] = tsys
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
        rows = "\n".join(f"| gravac/{tag} | {text} |" for tag, text in TAG_DESCRIPTIONS.items())
        self.writer.add_text("gravac/tags", f"| tag | meaning |\n|---|---|\n{rows}", 0)

    def log(self, record: StepRecord) -> None:
        for tag, value in record.scalars().items():
            self.writer.add_scalar(f"gravac/{tag}", value, record.step)
        if record.step % self.flush_every == 0:
            self.writer.flush()

    def close(self) -> None:
        self.writer.flush()
        if self._owned:
            self.writer.close()
