"""argparse value types shared by the command lines (``trainguard`` and its verbs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_in", "non_negative_int"]


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """The type of an integer from ``low`` (up to ``high``, if given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
        return value

    return parse


non_negative_int = int_in(0)
