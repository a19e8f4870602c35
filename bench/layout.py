"""The layout of ``results.json``: which keys hold which side, and where a ratio is kept.

A scenario's result has one key per side: ``trainguard`` (and other trainguard variants,
``trainguard_<variant>``), one ``baseline...`` key per baseline, and ``ratio``: each
trainguard variant's median over each baseline's, under :func:`ratio_key`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ratio_key", "sides", "variant_label"]


def ratio_key(variant: str, metric: str, baseline: str) -> str:
    """``stall_s_vs_baseline_relaunch`` for ``trainguard``; prefixed by any other variant."""
    prefix = "" if variant == "trainguard" else f"{variant}_"
    return f"{prefix}{metric}_vs_{baseline}"


def sides(result: dict[str, Any], side: str) -> list[str]:
    """The keys of ``result`` holding one side's figures (``trainguard`` or ``baseline``)."""
    return [k for k in result if k.startswith(side) and isinstance(result[k], dict)]


def variant_label(variant: str) -> str:
    """How a table names a trainguard variant: '' for plain ``trainguard``."""
    return variant.removeprefix("trainguard").removeprefix("_").replace("_", " ")
