"""docs/elastic.md, in place: the block defines `train()` and leaves the call to the script."""

from __future__ import annotations

from typing import Any

from resilient_train import namespace

__all__ = ["after", "namespace"]


def after(namespace: dict[str, Any]) -> None:
    namespace["train"]()
