"""The workloads scenario's rows of the summary table, and its own table (results of
:func:`bench.workloads.scenario`).

Per workload: the recovery rows (:func:`bench.table_rows.fault_rows`, labelled by the
workload) and the checkpoint rows (save blocking against a plain copy and
``torch.save``, restore from the memory tier against the durable tier and
``torch.load``). :func:`workloads_table` lays the same figures out one column per
workload, beside the small MLP's recovery figures when the results have them.
"""

from __future__ import annotations

from typing import Any

from bench.table_rows import Fmt, Row, _x, cell, count, fault_rows, millis, seconds, verdict

SCENARIO = "workloads"
REFERENCE_KEY = "small_mlp_checkpoint"
"""Where the results keep the small MLP's checkpoint figures."""

RECOVERY: list[tuple[str, str, Fmt, bool]] = [
    ("stall_s", "stall: fault -> next completed step", seconds, True),
    ("lost_steps", "steps lost (redone)", count, True),
]
# (trainguard's figure, label, baseline figure, baseline name, ratio key)
CHECKPOINT: list[tuple[str, str, str, str, str]] = [
    ("trainguard_save_s", "save() blocking", "baseline_memcpy_s", "plain copy", "save_vs_memcpy"),
    (
        "trainguard_save_s",
        "save() blocking",
        "baseline_torch_save_s",
        "torch.save",
        "save_vs_torch_save",
    ),
    (
        "trainguard_restore_memory_s",
        "restore from memory",
        "trainguard_restore_durable_s",
        "trainguard's durable tier",
        "restore_memory_vs_durable",
    ),
    (
        "trainguard_restore_memory_s",
        "restore from memory",
        "baseline_torch_load_s",
        "torch.load",
        "restore_memory_vs_torch_load",
    ),
]
VARIANTS = {
    "trainguard_checkpointless": "checkpointless (hot spare)",
    "trainguard": "process-level restart",
    "baseline_relaunch": "torchrun relaunch",
}


def _names(res: dict[str, Any]) -> list[str]:
    return [k for k, v in res.items() if isinstance(v, dict) and "recovery" in v]


def _ms_or_s(v: float) -> str:
    if v < 0.01:
        return f"{v * 1e3:.2f} ms"
    return millis(v) if v < 1 else seconds(v)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 10e6 else f"{nbytes / 1e6:.0f} MB"


def workloads_rows(res: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for name in _names(res):
        part = res[name]
        labelled = [(k, f"{name}: {label}", fmt, lower) for k, label, fmt, lower in RECOVERY]
        rows += fault_rows(SCENARIO, part["recovery"], labelled)
        ckpt = part.get("checkpoint") or {}
        if "error" in ckpt:
            rows.append(Row(SCENARIO, f"{name}: checkpoint", "—", "—", "—", "—", ckpt["error"]))
            continue
        for ours, label, theirs, baseline, key in CHECKPOINT:
            if ours not in ckpt:
                continue
            r = ckpt.get(f"ratio_{key}")
            size = f"{name} ({_mb(ckpt['state_bytes'])} state): {label}"
            rows.append(
                Row(
                    SCENARIO,
                    size,
                    cell(ckpt[ours], _ms_or_s),
                    baseline,
                    cell(ckpt[theirs], _ms_or_s),
                    _x(r),
                    verdict(r, True),
                )
            )
    return rows


def workloads_table(results: dict[str, Any]) -> str:
    """One column per workload (the small MLP's recovery figures first, when measured)."""
    res = results.get(SCENARIO) or {}
    names = _names(res)
    if not names:
        return ""
    columns: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    small = res.get(REFERENCE_KEY) or {}
    columns.append(("small MLP", results.get("recovery") or {}, small))
    columns += [(n, res[n]["recovery"], res[n].get("checkpoint") or {}) for n in names]
    head = "| | " + " | ".join(c[0] for c in columns) + " |"
    lines = [head, "| --- |" + " --- |" * len(columns)]

    def line(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    line("state per rank", [_state(ck) for _, _, ck in columns])
    line("step time (median)", [_step(n, res) for n, _, _ in columns])
    for variant, label in VARIANTS.items():
        line(
            f"stall: {label}",
            [cell((rec.get(variant) or {}).get("stall_s"), seconds) for _, rec, _ in columns],
        )
        line(
            f"steps redone: {label}",
            [cell((rec.get(variant) or {}).get("lost_steps"), count) for _, rec, _ in columns],
        )
    for ours, label, theirs, baseline, _ in CHECKPOINT:
        if "copy" in baseline or "durable" in baseline:
            line(f"{label} / {baseline}", [_pair(ck, ours, theirs) for n, _, ck in columns])
    return "\n".join(lines)


def _state(ckpt: dict[str, Any]) -> str:
    if "state_bytes" not in ckpt:
        return "—"
    return f"{_mb(ckpt['state_bytes'])} ({ckpt['state_tensors']} tensors)"


def _step(name: str, res: dict[str, Any]) -> str:
    return cell((res.get(name) or {}).get("step_s"), _ms_or_s)


def _pair(ckpt: dict[str, Any], ours: str, theirs: str) -> str:
    if ours not in ckpt or theirs not in ckpt:
        return "—"
    a, b = ckpt[ours]["median"], ckpt[theirs]["median"]
    return f"{_ms_or_s(a)} / {_ms_or_s(b)} ({_x(a / b)})"
