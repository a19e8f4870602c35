"""One table row per (scenario, metric, baseline), from the results of :mod:`bench.suite`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.layout import ratio_key, sides, variant_label

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


def _labelled(metric: str, variant: str) -> str:
    """The metric's label, naming the trainguard variant unless it is plain ``trainguard``."""
    label = variant_label(variant)
    return f"{metric} ({label})" if label else metric


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
    for key, label, fmt, lower in _FAULT_METRICS[scenario]:
        for variant in sides(res, "trainguard"):
            for name in sides(res, "baseline"):
                theirs, ratio_cell, v = _fault_cells(scenario, res, variant, name, key, fmt, lower)
                ours = cell(res[variant][key], fmt)
                rows.append(
                    Row(
                        scenario,
                        _labelled(label, variant),
                        ours,
                        _name(name),
                        theirs,
                        ratio_cell,
                        v,
                    )
                )
    return rows


def _fault_cells(
    scenario: str, res: dict[str, Any], variant: str, name: str, key: str, fmt: Fmt, lower: bool
) -> tuple[str, str, str]:
    """The baseline's cell, the ratio's and the verdict's, for one metric of one pair."""
    ours, theirs = res[variant], res[name]
    cap = res.get("setup", {}).get("cap_s")
    r = res["ratio"].get(ratio_key(variant, key, name))
    at_most = res["ratio"].get(ratio_key(variant, key, name) + "_at_most")
    if theirs[key]["n"]:
        v = verdict(r, lower)
        if theirs[key]["n"] < theirs[key]["runs"]:
            v += f"; the baseline recovered in {theirs[key]['n']}/{theirs[key]['runs']}"
        return cell(theirs[key], fmt), _x(r), v
    if at_most is not None:
        return f"none within the {cap:g} s cap", f"< {at_most:.2f}x", "trainguard better"
    if cap is not None and scenario == "hang":
        inconclusive = "inconclusive (trainguard took longer than the cap)"
        return f"none within the {cap:g} s cap", "—", inconclusive
    if not theirs["recovered"]:
        v = "trainguard better" if ours["recovered"] else "neither recovered"
        return f"did not recover (0/{len(theirs['runs'])} runs)", "—", v
    return "—", "—", "—"


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
    for variant in sides(res, "trainguard"):
        for name in sides(res, "baseline"):
            r = res["ratio"].get(ratio_key(variant, key, name))
            rows.append(
                Row(
                    scenario,
                    _labelled(label, variant),
                    cell(res[variant][key], fmt),
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
