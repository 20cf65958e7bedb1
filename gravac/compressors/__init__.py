"""Gradient compressors and their registry.

``names()`` lists the registered compressors; ``create(name, **options)`` builds one.
"""

from gravac.compressors import dense, dgc, powersgd, randomk, redsync, thc, topk, topkc
from gravac.compressors.base import (
    Agreeing,
    Collective,
    Compressor,
    Context,
    Multilevel,
    Payload,
    Replayable,
    Round,
    StatsRule,
    check_cf,
    k_for_cf,
    payload_tensors,
    sum_payloads,
    wire_bytes,
)
from gravac.compressors.registry import create, get, names, options, register

__all__ = [
    "Agreeing",
    "Collective",
    "Compressor",
    "Context",
    "Multilevel",
    "Payload",
    "Replayable",
    "Round",
    "StatsRule",
    "check_cf",
    "create",
    "dense",
    "dgc",
    "get",
    "k_for_cf",
    "names",
    "options",
    "payload_tensors",
    "powersgd",
    "randomk",
    "redsync",
    "register",
    "sum_payloads",
    "thc",
    "topk",
    "topkc",
    "wire_bytes",
]
