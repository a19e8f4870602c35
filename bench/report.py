"""Summaries, the machine, and the Markdown tables built from ``results.json``.

The tables are a pure function of the results, so they can be rebuilt from a saved
``results.json`` (``python -m bench --table-only``).
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lost_time import PARTS
from bench.peers.table import peers_table
from bench.table_rows import scale_table, summary_rows
from bench.workloads_rows import workloads_table

Number = float | int


def summary(values: Sequence[Number | None]) -> dict[str, Any]:
    """Median, min and max of the values that exist; ``n`` of ``runs`` had one."""
    present = [float(v) for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0, "runs": len(values)}
    return {
        "median": statistics.median(present),
        "min": min(present),
        "max": max(present),
        "n": len(present),
        "runs": len(values),
    }


def ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    """Median over median; None when either side has no value; 1 when both are 0."""
    a, b = ours.get("median"), theirs.get("median")
    if a is None or b is None or (b == 0 and a != 0):
        return None
    return 1.0 if a == b else float(a) / float(b)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    model = "unknown"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = next(
        (
            int(line.split()[1])
            for line in _read("/proc/meminfo").splitlines()
            if "MemTotal" in line
        ),
        0,
    )
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kib / 2**20, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "shm_gib": round(_statvfs_gib("/dev/shm"), 1),
    }


def load_average() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True)
class Tables:
    summary: str
    scale: str


def tables(results: dict[str, Any]) -> Tables:
    rows = summary_rows(results)
    head = [
        "| scenario | metric | trainguard | baseline | baseline figure | ratio | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    body = [
        f"| {r.scenario} | {r.metric} | {r.ours} | {r.baseline} | {r.theirs} | {r.ratio} "
        f"| {r.verdict} |"
        for r in rows
    ]
    return Tables("\n".join(head + body), scale_table(results.get("scale")))


def markdown(results: dict[str, Any]) -> str:
    """The whole report: the machine, the summary table, the scale table, the notes."""
    m = results.get("machine", {})
    t = tables(results)
    lines = [
        "# trainguard benchmarks",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('ram_gib')} GiB RAM, "
        f"torch {m.get('torch')}, Python {m.get('python')}, Linux {m.get('kernel')}. "
        f"`{results.get('command', 'make bench').strip()}` took {results.get('wall_s', 0):.0f} s; "
        f"load average {results.get('load_before', 0):.2f} before, "
        f"{results.get('load_after', 0):.2f} after.",
        "",
        "Figures are median (min-max) over the repetitions; ratio = trainguard / baseline "
        "(medians; for recovery and hang, over the repetitions where both sides recovered).",
        "",
        t.summary,
    ]
    if "| goal |" in t.summary:
        lines[-1:-1] = [
            "A `goal` row compares a figure with the control plane's goal for it, the most "
            "it may be on this machine (ratio = figure / goal).",
            "",
        ]
    if t.scale:
        lines += ["", t.scale]
    others = workloads_table(results)
    if others:
        lines += [
            "",
            "Other workloads (`workloads`; the small MLP's recovery figures are the "
            "recovery scenario's):",
            "",
            others,
        ]
    peers = peers_table(results.get("peers"))
    if peers:
        lines += ["", peers]
    lost = lost_time_table(results.get("goodput"))
    if lost:
        lines += ["", lost]
    notes = _notes(results)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def lost_time_table(res: dict[str, Any] | None) -> str:
    """The goodput scenario's window, split by where the time went (bench.lost_time)."""
    runs = {
        name: side["runs"][0]["lost"]
        for name, side in (res or {}).items()
        if isinstance(side, dict) and side.get("runs") and side["runs"][0].get("lost")
    }
    if not runs:
        return ""
    names = list(runs)
    keys = ["useful", *PARTS, "slow steps after recovery"]
    lines = [
        "Goodput: where the window's time went (seconds, and share of the window; "
        "`slow steps after recovery` is inside `useful`):",
        "",
        "| part | " + " | ".join(n.replace("_", " ") for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for key in keys:
        cells = []
        for name in names:
            lost = runs[name]
            share = lost[key] / lost["window"] if lost.get("window") else 0.0
            cells.append(f"{lost[key]:.1f} s ({100 * share:.1f}%)")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _notes(results: dict[str, Any]) -> list[str]:
    """Every distinct note a run left (why a baseline did not recover, ...)."""
    seen: list[str] = []
    for scenario, res in _fault_results(results):
        for name, side in res.items():
            if not isinstance(side, dict):
                continue
            for run in side.get("runs", []):
                note = run.get("note") if isinstance(run, dict) else None
                text = f"{scenario}, {name}: {note}" if note else None
                if text and text not in seen:
                    seen.append(text)
    for name in ("hosts", "slurm"):
        part = results.get(name) or {}
        if "skipped" in part:
            seen.append(f"{name}: not measured: {part['skipped']}")
    return seen


def _fault_results(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The results whose sides keep runs with notes: (label, result)."""
    found = [(s, results.get(s) or {}) for s in ("recovery", "hang", "goodput")]
    hosts = results.get("hosts") or {}
    found += [(f"hosts ({part})", hosts[part]) for part in ("kill", "cut") if part in hosts]
    slurm = results.get("slurm") or {}
    found += [("slurm (node lost)", slurm["lost"])] if "lost" in slurm else []
    others = results.get("workloads") or {}
    found += [
        (f"workloads ({k})", v["recovery"])
        for k, v in others.items()
        if isinstance(v, dict) and "recovery" in v
    ]
    return found


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _statvfs_gib(path: str) -> float:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0.0
    return st.f_blocks * st.f_frsize / 2**30
