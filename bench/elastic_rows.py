"""The elastic scenario's rows of the summary table (results of :mod:`bench.elastic`)."""

from __future__ import annotations

from typing import Any

from bench.layout import ratio_key, sides
from bench.table_rows import (
    Fmt,
    Row,
    _labelled,
    _name,
    _x,
    cell,
    count,
    goal_row,
    rate,
    seconds,
    times,
    verdict,
)

SCENARIO = "elastic"

DOWN, UP = "scale-down: ", "scale-up: "
SMALLER, LARGER = "first step at the smaller size", "first step at the larger size"
# (metric key, label, format, lower is better)
_METRICS: list[tuple[str, str, Fmt, bool]] = [
    ("down_s", f"{DOWN}preemption -> {SMALLER}", seconds, True),
    ("down_from_decision_s", f"{DOWN}decision -> {SMALLER}", seconds, True),
    ("down_stall_s", f"{DOWN}last step -> {SMALLER}", seconds, True),
    ("down_lost_steps", f"{DOWN}steps lost (redone)", count, True),
    ("up_s", f"{UP}decision -> {LARGER}", seconds, True),
    ("up_from_capacity_s", f"{UP}capacity given -> {LARGER}", seconds, True),
    ("up_stall_s", f"{UP}last step -> {LARGER}", seconds, True),
    ("up_lost_steps", f"{UP}steps lost (redone)", count, True),
    ("steps_per_s_before", "throughput before the preemption (steps/s)", rate, False),
    ("steps_per_s_between", "throughput at the smaller size (steps/s)", rate, False),
    ("steps_per_s_after", "throughput after the scale-up (steps/s)", rate, False),
]
# A ratio the issue sets a target for: (ratio's metric, goal key, label)
_RATIO_GOALS = {
    "down_s": ("down_s_ratio", "scale-down time / checkpoint-restart's"),
    "up_s": ("up_s_ratio", "scale-up time / checkpoint-restart's"),
}


def elastic_rows(res: dict[str, Any]) -> list[Row]:
    """The path each side took, every figure against each baseline, and the issue's
    targets against what was measured."""
    rows: list[Row] = []
    goals = res.get("goals") or {}
    for variant in sides(res, "trainguard"):
        for name in sides(res, "baseline"):
            rows.append(_path_row(res, variant, name))
            for key, label, fmt, lower in _METRICS:
                k = ratio_key(variant, key, name)
                if k not in res["ratio"] or key not in res[variant]:
                    continue
                r = res["ratio"][k]
                metric = _labelled(label, variant)
                ours = cell(res[variant][key], fmt)
                rows.append(
                    Row(
                        SCENARIO,
                        metric,
                        ours,
                        _name(name),
                        cell(res[name][key], fmt),
                        _x(r),
                        verdict(r, lower),
                    )
                )
                if key in _RATIO_GOALS and _RATIO_GOALS[key][0] in goals:
                    goal_key, goal_label = _RATIO_GOALS[key]
                    label = _labelled(f"{goal_label} (issue target)", variant)
                    rows.append(goal_row(SCENARIO, label, r, goals[goal_key], times))
                if key == "down_lost_steps" and "down_lost_steps" in goals:
                    rows.append(_zero_goal_row(res[variant][key], goals[key], metric))
    return rows + _note_rows(res)


def _note_rows(res: dict[str, Any]) -> list[Row]:
    """What went wrong in a run (a job that failed, a scaling that never happened)."""
    rows = []
    for side in [*sides(res, "trainguard"), *sides(res, "baseline")]:
        notes = list(dict.fromkeys(r["note"] for r in res[side].get("runs", []) if r.get("note")))
        if notes:
            label = f"notes of {side.replace('_', ' ')}"
            rows.append(Row(SCENARIO, label, "—", "—", "—", "—", "; ".join(notes)))
    return rows


def _path_row(res: dict[str, Any], variant: str, name: str) -> Row:
    """How each side scaled down and up (in-process or restart), over its runs."""
    return Row(
        SCENARIO,
        _labelled("path taken (scale-down / scale-up)", variant),
        _paths(res[variant]),
        _name(name),
        _paths(res[name]),
        "—",
        "—",
    )


def _paths(side: dict[str, Any]) -> str:
    paths = side.get("paths") or {}
    return " / ".join(_path_counts(paths.get(d) or {}) for d in ("down", "up"))


def _path_counts(counts: dict[str, int]) -> str:
    """``in-process`` when every run took it, else ``in-process 2, restart 1``."""
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{path} {n}" for path, n in sorted(counts.items())) or "—"


def _zero_goal_row(stats: dict[str, Any], goal: float, metric: str) -> Row:
    """The worst run's steps lost against a target of at most ``goal`` (0: no ratio)."""
    worst = stats.get("max")
    ours = "—" if worst is None else f"{count(worst)} (worst run)"
    if worst is None:
        return Row(SCENARIO, metric, ours, "goal", f"<= {count(goal)}", "—", "—")
    met = "meets the goal" if worst <= goal else "**misses the goal**"
    return Row(SCENARIO, metric, ours, "goal", f"<= {count(goal)}", "—", met)
