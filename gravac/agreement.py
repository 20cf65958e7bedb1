"""Checking that every rank trains with the same configuration and parameter layout.

Ranks that disagree do not fail loudly on their own: parameters listed in another order mix each
other's gradients, a different ``theta_min`` trains silently wrong, a different compressor or
``epsilon`` hangs in mismatched collectives, different shapes abort inside the backend. So the
optimizer all-gathers a digest of each part of its configuration (one 64-bit integer each, one
small collective) at the first step and whenever its bucket layout changes, and every rank raises
the same error, naming what differs and on which ranks, before any payload is exchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from gravac.comm import Communicator

__all__ = ["check_agreement", "digest", "layout_text"]

#: Bytes of each digest: one int64 per part.
_DIGEST_BYTES = 8
#: Characters of this rank's value shown in the error (a parameter layout can be long).
_SHOWN = 300


def digest(text: str) -> int:
    """A signed 64-bit digest of ``text`` (BLAKE2b), the same on every machine."""
    raw = hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest()
    return int.from_bytes(raw, "little", signed=True)


def layout_text(params: Sequence[Tensor]) -> str:
    """The order, shapes, dtypes and trainability of ``params`` as text."""
    return ";".join(f"{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for p in params)


def check_agreement(
    comm: Communicator, parts: dict[str, str], device: torch.device | str = "cpu"
) -> None:
    """Raise on every rank if any rank's ``parts`` (name -> text) differ from rank 0's.

    Raises:
        ValueError: the message names every differing part and the ranks that differ from
            rank 0.
    """
    if comm.world_size == 1:
        return
    local = torch.tensor([digest(t) for t in parts.values()], dtype=torch.int64, device=device)
    gathered = comm.all_gather_async(local).named("the configuration digests").wait()
    table = torch.stack(gathered).cpu()
    differing = {}
    for i, name in enumerate(parts):
        ranks = [r for r in range(comm.world_size) if table[r, i] != table[0, i]]
        if ranks:
            differing[name] = ranks
    if differing:
        what = "; ".join(
            f"{name} (ranks {ranks} differ from rank 0)" for name, ranks in differing.items()
        )
        mine = "; ".join(f"{name}: {parts[name][:_SHOWN]}" for name in differing)
        raise ValueError(f"ranks disagree on {what}. This rank ({comm.rank}) has {mine}")
