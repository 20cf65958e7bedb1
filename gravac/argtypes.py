"""Option parsers shared by the command-line subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

__all__ = ["argtype"]

T = TypeVar("T")


def argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Turn a parser's ValueError into argparse's error (status 2, the message verbatim)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert
