"""argparse value types shared by the command lines (``trainguard`` and its verbs)."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int"]


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
