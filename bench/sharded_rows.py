"""The sharded scenario's rows of the summary table (results of :func:`bench.sharded.scenario`).

Per layout, each labelled with its state size per rank: the recovery rows (stall and
steps redone, every trainguard variant against the relaunch), ``stall + steps redone``
of each variant against the relaunch's (the checkpointless one judged against its
target), and save() blocking against DCP's ``async_save`` (judged against its target).
"""

from __future__ import annotations

from typing import Any

from bench.layout import ratio_key
from bench.table_rows import Fmt, Row, _x, cell, count, fault_rows, seconds, verdict

SCENARIO = "sharded"
LAYOUT_NAMES = {"hsdp": "HSDP 2x2", "fsdp": "FSDP 1x4"}
RECOVERY: list[tuple[str, str, Fmt, bool]] = [
    ("stall_s", "stall: fault -> next completed step", seconds, True),
    ("lost_steps", "steps lost (redone)", count, True),
]
VARIANTS = ("trainguard_checkpointless", "trainguard")
BASELINE = "baseline_relaunch"


def _mb(nbytes: float | None) -> str:
    return "? MB/rank" if nbytes is None else f"{nbytes / 1e6:.1f} MB/rank"


def judged(r: float | None, target: float | None) -> str:
    """A ratio against its ``<=`` target (lower is better), or the plain verdict."""
    if r is None or target is None:
        return verdict(r, True)
    return f"target <= {target}x met" if r <= target else f"**misses the <= {target}x target**"


def state_bytes(part: dict[str, Any]) -> float | None:
    """The training runs' state per rank, else the save measurement's (the same model)."""
    value = part.get("state_bytes_per_rank")
    if value is None:
        value = (part.get("checkpoint") or {}).get("state_bytes_per_rank")
    return float(value) if value is not None else None


def sharded_rows(res: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    targets = res.get("targets") or {}
    for layout, name in LAYOUT_NAMES.items():
        part = res.get(layout)
        if not part:
            continue
        prefix = f"{name} ({_mb(state_bytes(part))})"
        recovery = part["recovery"]
        labelled = [(k, f"{prefix}: {label}", fmt, lower) for k, label, fmt, lower in RECOVERY]
        rows += fault_rows(SCENARIO, recovery, labelled)
        for variant in VARIANTS:
            if "lost_s" not in recovery.get(variant, {}):
                continue
            r = recovery["ratio"].get(ratio_key(variant, "lost_s", BASELINE))
            target = targets.get(f"{layout}_checkpointless_lost_s_vs_relaunch")
            label = "checkpointless" if variant != "trainguard" else "process-level restart"
            rows.append(
                Row(
                    SCENARIO,
                    f"{prefix}: stall + steps redone ({label})",
                    cell(recovery[variant]["lost_s"], seconds),
                    "torchrun relaunch, DCP from disk",
                    cell(recovery[BASELINE]["lost_s"], seconds),
                    _x(r),
                    judged(r, target if variant == "trainguard_checkpointless" else None),
                )
            )
        rows.append(save_row(prefix, part.get("checkpoint") or {}, targets))
    return rows


def save_row(prefix: str, ckpt: dict[str, Any], targets: dict[str, Any]) -> Row:
    label = f"{prefix}: save() blocking"
    if "error" in ckpt:
        return Row(SCENARIO, label, "—", "DCP async_save", "—", "—", ckpt["error"])
    r = ckpt["ratio"]["save_vs_dcp_async_save"]
    return Row(
        SCENARIO,
        label,
        cell(ckpt["trainguard_save_s"], seconds),
        "DCP async_save",
        cell(ckpt["baseline_dcp_async_save_s"], seconds),
        _x(r),
        judged(r, targets.get("save_vs_dcp_async_save")),
    )
