"""A block that is a whole program (a torchrun script): it needs nothing around it."""

from __future__ import annotations

from typing import Any


def namespace() -> dict[str, Any]:
    return {}
