"""The ``peers`` scenario's tables for ``bench/results.md`` (pure; tested without peers)."""

from __future__ import annotations

from typing import Any

from bench.layout import ratio_key
from bench.table_rows import cell, count, seconds

LABELS = {
    "trainguard_checkpointless": "trainguard checkpointless (hot spare)",
    "trainguard": "trainguard process-level restart",
    "peer_torchft": "torchft",
    "peer_nvrx": "NVRx in-process Wrapper (spare)",
    "baseline_relaunch": "torchrun relaunch",
    "trainguard_memory": "trainguard memory tier",
    "sagemaker": "SageMaker tiered checkpointing (memory tier)",
    "dlrover": "DLRover flash checkpoint (memory; restored in the same process)",
}
OURS = ("trainguard_checkpointless", "trainguard")


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _world(stats: dict[str, Any] | None) -> str:
    return cell(stats, count)


def recovery_table(res: dict[str, Any], versions: dict[str, str]) -> list[str]:
    names = [k for k in LABELS if k in res and isinstance(res[k], dict) and "runs" in res[k]]
    head = (
        "| system | stall after the kill | steps redone | world after | back to full world "
        "| checkpointless / this (stall) | process-level / this (stall) |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        side = res[name]
        peer = name.removeprefix("peer_")
        label = LABELS[name] + (f" {versions[peer]}" if peer in versions else "")
        runs = len(side["runs"])
        if side.get("recovered", runs) < runs:
            label += f" [recovered {side['recovered']}/{runs}]"
        if "measured_apart" in side:
            label += " [its runs after the others']"
        ratios = [
            "—" if name == ours else _ratio(res["ratio"].get(ratio_key(ours, "stall_s", name)))
            for ours in OURS
        ]
        lines.append(
            f"| {label} | {cell(side.get('stall_s'), seconds)} "
            f"| {cell(side.get('lost_steps'), count)} | {_world(side.get('world_after'))} "
            f"| {cell(side.get('world_restored_s'), seconds)} | {ratios[0]} | {ratios[1]} |"
        )
    return lines


def checkpoint_table(
    ckpt: dict[str, Any], versions: dict[str, str], ratios: dict[str, Any]
) -> list[str]:
    lines = [
        "| system | save blocking | restore | identical | trainguard / this (save) "
        "| trainguard / this (restore) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, side in ckpt.items():
        if "skipped" in side:
            continue
        label = LABELS.get(name, name) + (f" {versions[name]}" if name in versions else "")
        pair = [
            "—"
            if name == "trainguard_memory"
            else _ratio(ratios.get(f"trainguard_memory_{m}_vs_peer_{name}"))
            for m in ("save_s", "restore_s")
        ]
        lines.append(
            f"| {label} | {cell(side.get('save_s'), seconds)} "
            f"| {cell(side.get('restore_s'), seconds)} | {side.get('identical')} "
            f"| {pair[0]} | {pair[1]} |"
        )
    return lines


def _label(key: str) -> str:
    name = key.removeprefix("checkpoint_")
    return LABELS.get(name, name)


def peers_table(res: dict[str, Any] | None) -> str:
    """The peer tables and the skipped peers' reasons; '' without a peers result."""
    if not res or "ratio" not in res:
        if res and "skipped" in res:
            return f"Against other systems (`peers`): not measured: {res['skipped']}"
        return ""
    setup = res.get("setup", {})
    versions = setup.get("environment", {}).get("versions", {})
    lines = [
        f"Against other systems (`peers`; {setup.get('fault')} of a {setup.get('world')}-rank "
        f"gloo job, {setup.get('steps')} steps of {setup.get('step_sleep_s')} s simulated "
        f"compute, {setup.get('repeats')} interleaved repetitions; peers in their own "
        f"environment, torch {versions.get('torch')}; load average "
        f"{setup.get('load_before', 0):.1f} before, {setup.get('load_after', 0):.1f} after). "
        "Ratios: the trainguard side's stall / this system's (medians):",
        "",
        *recovery_table(res, versions),
    ]
    ckpt = res.get("checkpoint") or {}
    if ckpt:
        lines += [
            "",
            f"Save blocking and restore of {setup.get('checkpoint_mib')} MiB "
            f"({setup.get('checkpoint_saves')} saves per process, one gloo rank); ratio = "
            "trainguard's memory tier / this system's (medians):",
            "",
            *checkpoint_table(ckpt, versions, res["ratio"]),
        ]
    skipped = res.get("skipped") or {}
    if skipped:
        lines += ["", "Not measured:", ""]
        lines += [f"- {_label(k)}: {why}" for k, why in skipped.items()]
    return "\n".join(lines)
