"""The link model: a step's time at a CF never sent, from the steps that were timed.

A step's seconds per sample are its compute and compression plus the communication it waited
for (what backward did not hide). The communication scales with the bytes sent, ``1 / cf``;
where two CFs around ``cf`` were timed, all that their times differ by scales so (on the CPU,
compression also grows with the elements kept). The searches by trial and by shadow read it to
skip CFs that cannot pay and to time CFs they do not send.
"""

from __future__ import annotations

__all__ = ["between_seconds", "link_seconds"]


def link_seconds(cf: float, anchor: float, seconds: float, comm: float) -> float:
    """Seconds per sample at ``cf`` from one measured at ``anchor``: ``seconds`` in all, of
    which ``comm`` waiting for communication; the communication scales with the bytes, as
    ``1 / cf``, the rest stays::

        t(cf) = (seconds - comm) + comm * anchor / cf
    """
    return seconds - comm + comm * anchor / cf


def between_seconds(cf: float, lo: float, t_lo: float, hi: float, t_hi: float) -> float:
    """Seconds per sample at ``cf`` between two CFs whose steps were timed, ``lo < cf < hi``
    (``t_lo`` and ``t_hi`` seconds per sample): linear in the bytes sent, ``1 / cf``::

        t(cf) = t_hi + (t_lo - t_hi) * (1/cf - 1/hi) / (1/lo - 1/hi)

    Unlike :func:`link_seconds` it scales all that the two steps' times differ by, not only
    the communication waited for: where compression costs grow with the elements kept (Top-k
    on the CPU), they are part of what a higher CF saves."""
    return t_hi + (t_lo - t_hi) * (1.0 / cf - 1.0 / hi) / (1.0 / lo - 1.0 / hi)
