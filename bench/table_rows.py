"""One table row per (scenario, metric, baseline), from the results of :mod:`bench.suite`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Fmt = Callable[[float], str]


@dataclass(frozen=True)
class Row:
    scenario: str
    metric: str
    ours: str
    baseline: str
    theirs: str
    ratio: str
    verdict: str


def seconds(v: float) -> str:
    return f"{v:.2f} s" if v < 1 else f"{v:.1f} s"


def millis(v: float) -> str:
    return f"{v * 1e3:.0f} ms"


def count(v: float) -> str:
    return f"{v:g}"


def percent(v: float) -> str:
    return f"{v * 100:.1f}%"


def rate(v: float) -> str:
    return f"{v:.1f}/s"


def gbps(v: float) -> str:
    return f"{v:.1f} GB/s"


def cell(stats: dict[str, Any] | None, fmt: Fmt) -> str:
    """``median (min-max)``; ``[n/runs]`` when some runs had no value."""
    if not stats or stats.get("median") is None:
        return "—"
    text = fmt(stats["median"])
    if stats.get("min") is not None and stats["min"] != stats["max"]:
        text += f" ({fmt(stats['min'])}-{fmt(stats['max'])})"
    if "n" in stats and stats["n"] < stats["runs"]:
        text += f" [{stats['n']}/{stats['runs']} runs]"
    return text


def verdict(r: float | None, lower_is_better: bool) -> str:
    if r is None:
        return "—"
    if r == 1:
        return "even"
    better = r < 1 if lower_is_better else r > 1
    return "trainguard better" if better else "**trainguard worse**"


def _name(key: str) -> str:
    return key.removeprefix("baseline_").replace("_", " ")


# (metric key, label, format, lower is better)
_FAULT_METRICS: dict[str, list[tuple[str, str, Fmt, bool]]] = {
    "recovery": [
        ("stall_s", "stall: fault -> next completed step", seconds, True),
        ("lost_steps", "steps lost (redone)", count, True),
    ],
    "hang": [
        ("detect_s", "fault -> detected", seconds, True),
        ("stall_s", "fault -> next completed step", seconds, True),
    ],
}


def fault_rows(scenario: str, res: dict[str, Any]) -> list[Row]:
    rows = []
    ours = res["trainguard"]
    cap = res.get("setup", {}).get("cap_s")
    for key, label, fmt, lower in _FAULT_METRICS[scenario]:
        for name in [k for k in res if k.startswith("baseline")]:
            theirs = res[name]
            r = res["ratio"].get(f"{key}_vs_{name}")
            at_most = res["ratio"].get(f"{key}_vs_{name}_at_most")
            if theirs[key]["n"]:
                their_cell, ratio_cell, v = cell(theirs[key], fmt), _x(r), verdict(r, lower)
                if theirs[key]["n"] < theirs[key]["runs"]:
                    v += f"; the baseline recovered in {theirs[key]['n']}/{theirs[key]['runs']}"
            elif at_most is not None:
                their_cell = f"none within the {cap:g} s cap"
                ratio_cell, v = f"< {at_most:.2f}x", "trainguard better"
            elif cap is not None and scenario == "hang":
                their_cell = f"none within the {cap:g} s cap"
                ratio_cell, v = "—", "inconclusive (trainguard took longer than the cap)"
            elif not theirs["recovered"]:
                their_cell = f"did not recover (0/{len(theirs['runs'])} runs)"
                ratio_cell = "—"
                v = "trainguard better" if ours["recovered"] else "neither recovered"
            else:
                their_cell, ratio_cell, v = "—", "—", "—"
            rows.append(
                Row(scenario, label, cell(ours[key], fmt), _name(name), their_cell, ratio_cell, v)
            )
    return rows


def checkpoint_rows(res: dict[str, Any]) -> list[Row]:
    rows = []
    for size, r in res.items():
        if not isinstance(r, dict) or "trainguard_save_s" not in r:
            continue
        ours = cell(r["trainguard_save_s"], millis)
        for name, label in (("torch_save", "torch.save"), ("dcp_async_save", "DCP async_save")):
            x = r[f"ratio_save_vs_{name}"]
            rows.append(
                Row(
                    "checkpoint",
                    f"{size}: save() blocking",
                    ours,
                    label,
                    cell(r[f"baseline_{name}_s"], millis),
                    _x(x),
                    verdict(x, True),
                )
            )
        x = r["ratio_bandwidth_vs_memcpy"]
        rows.append(
            Row(
                "checkpoint",
                f"{size}: copy bandwidth",
                gbps(r["trainguard_bandwidth_gbps"]),
                "memcpy (pre-faulted)",
                gbps(r["baseline_memcpy_bandwidth_gbps"]),
                _x(x),
                verdict(x, False),
            )
        )
    return rows


# scenario -> (metric key, label, format, lower is better)
_SIMPLE = {
    "goodput": ("goodput", "useful step time / wall time", percent, False),
    "overhead": ("steps_per_s", "throughput, no faults (steps/s)", rate, False),
    "startup": ("first_step_s", "launch -> first completed step", seconds, True),
}


def simple_rows(scenario: str, res: dict[str, Any]) -> list[Row]:
    key, label, fmt, lower = _SIMPLE[scenario]
    rows = []
    for name in [k for k in res if k.startswith("baseline")]:
        r = res["ratio"].get(f"{key}_vs_{name}")
        rows.append(
            Row(
                scenario,
                label,
                cell(res["trainguard"][key], fmt),
                _name(name),
                cell(res[name][key], fmt),
                _x(r),
                verdict(r, lower),
            )
        )
    return rows


def scale_rows(res: dict[str, Any]) -> list[Row]:
    """The largest N against linear growth from the smallest."""
    sizes = sorted(res["trainguard"], key=int)
    if len(sizes) < 2:
        return []
    big = sizes[-1]
    rows = []
    for key, label in (("start_s", "assign + start all"), ("stop_s", "fault -> last /stop")):
        r = res["ratio"][big].get(key)
        growth = "—" if r is None else "**faster than linear**" if r > 1 else "linear or slower"
        rows.append(
            Row(
                "scale",
                f"{label}, {big} nodes",
                seconds(res["trainguard"][big][key]),
                f"linear growth from {sizes[0]} nodes",
                seconds(res[f"baseline_linear_from_{sizes[0]}"][big][key]),
                _x(r),
                growth,
            )
        )
    return rows


def summary_rows(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for scenario in ("recovery", "hang", "checkpoint", "goodput", "overhead", "startup", "scale"):
        res = results.get(scenario)
        if not res:
            continue
        if scenario in _FAULT_METRICS:
            rows += fault_rows(scenario, res)
        elif scenario == "checkpoint":
            rows += checkpoint_rows(res)
        elif scenario == "scale":
            rows += scale_rows(res)
        else:
            rows += simple_rows(scenario, res)
    return rows


def scale_table(res: dict[str, Any] | None) -> str:
    """Every N: the control plane's times and memory, and the growth exponent between Ns."""
    if not res:
        return ""
    lines = [
        "| nodes (x8 ranks) | assign + start all | fault -> last /stop | stop broadcast "
        "| status poll cycle | controller memory |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n in sorted(res["trainguard"], key=int):
        f = res["trainguard"][n]
        lines.append(
            f"| {n} | {seconds(f['start_s'])} | {seconds(f['stop_s'])} "
            f"| {seconds(f['stop_broadcast_s'])} | {seconds(f['poll_cycle_s'])} "
            f"| +{f['controller_rss_mib']:.0f} MiB (peak {f['controller_rss_peak_mib']:.0f} MiB) |"
        )
    growth = res.get("growth_exponent") or {}
    if growth:
        parts = ", ".join(f"{k} N^{v:.2f}" for k, v in growth.items() if v is not None)
        lines += ["", f"Growth from the smallest to the largest N (1.00 = linear): {parts}."]
    return "\n".join(lines)


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"
