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


def mib(v: float) -> str:
    return f"{v:.0f} MiB"


def mb(v: float) -> str:
    return f"{v:.0f} MB"


MB_PER_MIB = 1.048576


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


def goal_row(
    scenario: str,
    metric: str,
    stats: dict[str, Any] | float | None,
    goal: float,
    fmt: Fmt,
    scale: float = 1.0,
) -> Row:
    """Our figure (a summary's median, or a value; times ``scale``) against a goal it
    must not exceed."""
    if isinstance(stats, dict):
        ours_cell = cell(_scaled(stats, scale), fmt)
        value = stats.get("median")
    else:
        value = stats
        ours_cell = "—" if value is None else fmt(value * scale)
    if value is None:
        return Row(scenario, metric, ours_cell, "goal", f"<= {fmt(goal)}", "—", "—")
    r = value * scale / goal
    met = "meets the goal" if r <= 1 else "**misses the goal**"
    return Row(scenario, metric, ours_cell, "goal", f"<= {fmt(goal)}", _x(r), met)


def _scaled(stats: dict[str, Any], scale: float) -> dict[str, Any]:
    if scale == 1.0:
        return stats
    keys = ("median", "min", "max")
    return {k: v * scale if k in keys and v is not None else v for k, v in stats.items()}


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
        ("detect_s", "SIGKILL -> fault decision", millis, True),
    ],
    "hang": [
        ("detect_s", "fault -> detected", seconds, True),
        ("stall_s", "fault -> next completed step", seconds, True),
    ],
}


# Metrics only some baselines measure (torchrun restarting its workers itself says
# nothing of when it noticed): compared with those baselines alone, and with the goal.
_ONLY_WHERE_MEASURED = {("recovery", "detect_s"), ("hosts", "detect_s")}


def fault_rows(
    scenario: str,
    res: dict[str, Any],
    metrics: list[tuple[str, str, Fmt, bool]] | None = None,
) -> list[Row]:
    """Each trainguard variant against each baseline, for ``metrics`` (by default the
    scenario's in :data:`_FAULT_METRICS`), and against the goals."""
    rows = []
    goals = res.get("goals") or {}
    if "injection_lag_steps" in goals:
        for variant in sides(res, "trainguard"):
            lag = (res[variant].get("injection_lag_steps") or {}).get("max")
            label = _labelled("step injection: steps past the named step, worst run", variant)
            rows.append(goal_row(scenario, label, lag, goals["injection_lag_steps"], count))
    for key, label, fmt, lower in metrics or _FAULT_METRICS[scenario]:
        for variant in sides(res, "trainguard"):
            if key not in res[variant]:
                continue  # results of an older harness
            if key in goals:
                stats = res[variant][key]
                rows.append(goal_row(scenario, _labelled(label, variant), stats, goals[key], fmt))
            for name in sides(res, "baseline"):
                # A capped baseline's "none within the cap" is a measurement too.
                bounded = ratio_key(variant, key, name) + "_at_most" in res["ratio"]
                unmeasured = (scenario, key) in _ONLY_WHERE_MEASURED and not res[name][key]["n"]
                if unmeasured and not bounded:
                    continue
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
    capped = scenario == "hang" or name in res.get("setup", {}).get("capped_baselines", ())
    if cap is not None and capped:
        if key == "lost_steps":  # nothing to compare: the baseline never resumed
            return f"none within the {cap:g} s cap", "—", "—"
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
    rows += per_call_rows(res.get("per_call"))
    rows += spaced_rows(res.get("spaced"))
    rows += cuda_checkpoint_rows(res.get("cuda"))
    return rows


def per_call_rows(res: Any) -> list[Row]:
    """save() of small states of many tensors: against a copy of each tensor, and the goal."""
    rows: list[Row] = []
    for size, r in (res or {}).items():
        if not isinstance(r, dict) or "per_call_save_s" not in r:
            continue
        metric = f"{size} state of {r['tensors']} tensors: save() blocking"
        x = r["ratio_per_call_save_vs_copy"]
        ours = cell(r["per_call_save_s"], fine_millis)
        theirs = cell(r["per_call_copy_s"], fine_millis)
        rows.append(Row("checkpoint", metric, ours, "plain copy", theirs, _x(x), verdict(x, True)))
        goal = r["goal_per_call_save_s"]
        rows.append(goal_row("checkpoint", metric, r["per_call_save_s"], goal, fine_millis))
    return rows


def times(v: float) -> str:
    return f"{v:.2f}x"


def fine_millis(v: float) -> str:
    """Milliseconds, with a decimal below 10 ms (a non-blocking save returns in less)."""
    return f"{v * 1e3:.1f} ms" if v < 0.01 else millis(v)


def spaced_rows(r: Any) -> list[Row]:
    """Saves spaced like training steps, each against a plain copy into pre-faulted memory."""
    if not isinstance(r, dict) or "spaced_save_s" not in r:
        return []
    size, copy = r["size"], cell(r["spaced_memcpy_s"], fine_millis)
    spacing = f"{r['saves']} saves, {r['spacing_s']:g} s idle before each"
    x_first = r["ratio_first_save_vs_memcpy"]
    x_later = r["ratio_spaced_save_vs_memcpy"]
    rows = [
        Row(
            "checkpoint",
            f"{size}: first save() blocking, no load_latest ({spacing})",
            fine_millis(r["spaced_first_save_s"]),
            "memcpy (pre-faulted)",
            copy,
            _x(x_first),
            verdict(x_first, True),
        ),
        Row(
            "checkpoint",
            f"{size}: later save() blocking, no load_latest ({spacing})",
            cell(r["spaced_save_s"], fine_millis),
            "memcpy (pre-faulted)",
            copy,
            _x(x_later),
            verdict(x_later, True),
        ),
    ]
    goal = r.get("goal_ratio_spaced_save_vs_memcpy")
    if goal is not None:
        metric = f"{size}: later save() / memcpy (pre-faulted), spaced"
        rows.append(goal_row("checkpoint", metric, x_later, goal, times))
    return rows


def cuda_checkpoint_rows(res: Any) -> list[Row]:
    """The CUDA state's saves against device-to-host copies and torch.save; its restore."""
    if isinstance(res, str):
        return [Row("checkpoint", "CUDA state", "—", "—", "—", "—", f"not measured: {res}")]
    rows: list[Row] = []
    for size, r in (res or {}).items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            rows.append(Row("checkpoint", f"{size} CUDA", "—", "—", "—", "—", r["error"]))
            continue
        if "cuda_save_s" not in r:
            continue
        ours = cell(r["cuda_save_s"], fine_millis)
        for name, label in (
            ("pinned_copy", "D2H copy into pinned memory"),
            ("pageable_copy", "D2H copy into pageable memory"),
            ("torch_save", "torch.save (1 run)"),
        ):
            x = r.get(f"ratio_cuda_save_vs_{name}")
            rows.append(
                Row(
                    "checkpoint",
                    f"{size} CUDA: save() blocking",
                    ours,
                    label,
                    cell(r.get(f"baseline_{name}_s"), fine_millis),
                    _x(x),
                    verdict(x, True),
                )
            )
        pinned = cell(r["baseline_pinned_copy_s"], fine_millis)
        for key, label in (
            ("nonblocking", "save(blocking=False) until it returns"),
            ("nonblocking_complete", "save(blocking=False) until the copy is done"),
        ):
            x = r.get(f"ratio_cuda_save_{key}_vs_pinned_copy")
            rows.append(
                Row(
                    "checkpoint",
                    f"{size} CUDA: {label}",
                    cell(r.get(f"cuda_save_{key}_s"), fine_millis),
                    "D2H copy into pinned memory",
                    pinned,
                    _x(x),
                    verdict(x, True),
                )
            )
        x = r["cuda_save_bandwidth_gbps"] / r["baseline_pinned_copy_bandwidth_gbps"]
        rows.append(
            Row(
                "checkpoint",
                f"{size} CUDA: copy bandwidth",
                gbps(r["cuda_save_bandwidth_gbps"]),
                "D2H copy into pinned memory",
                gbps(r["baseline_pinned_copy_bandwidth_gbps"]),
                _x(x),
                verdict(x, False),
            )
        )
        identical = r.get("cuda_restore_identical")
        rows.append(
            Row(
                "checkpoint",
                f"{size} CUDA: restore from memory (load_latest, new Checkpointer)",
                cell(r.get("cuda_restore_s"), fine_millis),
                "—",
                "—",
                "—",
                "bit-identical" if identical else "**restored tensors differ**",
            )
        )
    return rows


def cpu_per_minute(v: float) -> str:
    return f"{v:.2f} CPU s/min"


# scenario -> [(metric key, label, format, lower is better)]
_SIMPLE: dict[str, list[tuple[str, str, Fmt, bool]]] = {
    "goodput": [("goodput", "useful step time / wall time", percent, False)],
    "overhead": [
        ("steps_per_s", "throughput, no faults (steps/s)", rate, False),
        (
            "launcher_cpu_s_per_min",
            "launcher's own processes' CPU while training",
            cpu_per_minute,
            True,
        ),
    ],
    "startup": [("first_step_s", "launch -> first completed step", seconds, True)],
}


def simple_rows(scenario: str, res: dict[str, Any]) -> list[Row]:
    """Each trainguard variant against each baseline it has a ratio with."""
    rows = []
    for key, label, fmt, lower in _SIMPLE[scenario]:
        for variant in sides(res, "trainguard"):
            for name in sides(res, "baseline"):
                k = ratio_key(variant, key, name)
                if k not in res["ratio"] or key not in res[variant]:
                    continue
                r = res["ratio"][k]
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


# (metric key, label, format): the agent against ``import torch``, lower is better.
_AGENT_METRICS: list[tuple[str, str, Fmt]] = [
    ("start_s", "node agent: spawn -> serving", seconds),
    ("cpu_s", "node agent: CPU time to serve", seconds),
    ("rss_peak_mib", "node agent: peak memory", mib),
]


def agent_rows(res: dict[str, Any]) -> list[Row]:
    """The agent's start and memory against ``import torch``, and against the goals."""
    rows = []
    goals = res.get("goals") or {}
    for key, label, fmt in _AGENT_METRICS:
        for variant in sides(res, "trainguard"):
            ours = res[variant][key]
            if key == "start_s" and "start_s" in goals:
                rows.append(goal_row("agent", _labelled(label, variant), ours, goals[key], fmt))
            if key == "rss_peak_mib" and "rss_peak_mb" in goals:
                rows.append(
                    goal_row(
                        "agent",
                        _labelled(label, variant),
                        ours,
                        goals["rss_peak_mb"],
                        mb,
                        MB_PER_MIB,
                    )
                )
            for name in sides(res, "baseline"):
                r = res["ratio"].get(ratio_key(variant, key, name))
                rows.append(
                    Row(
                        "agent",
                        _labelled(label, variant),
                        cell(ours, fmt),
                        "python -c 'import torch'" if "torch" in name else _name(name),
                        cell(res[name][key], fmt),
                        _x(r),
                        verdict(r, True),
                    )
                )
    return rows


# (figure key, label, format, factor to the goal's unit, goal key)
_SCALE_GOALS: list[tuple[str, str, Fmt, float, str]] = [
    ("start_s", "assign + start all", seconds, 1.0, "start_s"),
    ("stop_s", "fault -> last /stop", seconds, 1.0, "stop_s"),
    ("poll_cycle_s", "status poll cycle", seconds, 1.0, "poll_cycle_s"),
    ("controller_rss_peak_mib", "controller peak memory", mb, MB_PER_MIB, "controller_rss_peak_mb"),
]
_GROWTH_LABELS = {
    "start_s": "assign + start all",
    "stop_s": "fault -> last /stop",
    "poll_cycle_s": "status poll cycle",
    "controller_rss_mib": "controller memory",
}


def scale_goal_rows(res: dict[str, Any]) -> list[Row]:
    """The figures at the goals' N, and their growth to it, against the goals."""
    goals = res.get("goals") or {}
    n = str(goals.get("nodes"))
    figures = res["trainguard"].get(n)
    if figures is None:
        return []
    rows = [
        goal_row("scale", f"{label}, {n} nodes", figures.get(key), goals[goal], fmt, factor)
        for key, label, fmt, factor, goal in _SCALE_GOALS
        if goal in goals
    ]
    sizes = sorted(res["trainguard"], key=int)
    growth = res.get("growth_exponent_to_goal")
    if growth is None and sizes[-1] == n and sizes[0] != n:
        growth = res.get("growth_exponent")
    limit = goals.get("growth_exponent")
    if growth and limit:
        for key, label in _GROWTH_LABELS.items():
            value = growth.get(key)
            r = None if value is None else value / limit
            rows.append(
                Row(
                    "scale",
                    f"growth of {label}, {sizes[0]} -> {n} nodes",
                    "—" if value is None else f"N^{value:.2f}",
                    "goal",
                    f"<= N^{limit:.2f}",
                    _x(r),
                    "—" if r is None else "meets the goal" if r <= 1 else "**misses the goal**",
                )
            )
    return rows


def scale_rows(res: dict[str, Any]) -> list[Row]:
    """The goals, and the largest N against linear growth from the smallest."""
    sizes = sorted(res["trainguard"], key=int)
    rows = scale_goal_rows(res)
    if len(sizes) < 2:
        return rows
    big = sizes[-1]
    for key, label in (("start_s", "assign + start all"), ("stop_s", "fault -> last /stop")):
        r = res["ratio"][big].get(key)
        growth = "—" if r is None else "**slower than linear**" if r > 1 else "linear or better"
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
    for scenario in (
        "recovery",
        "hang",
        "checkpoint",
        "goodput",
        "overhead",
        "startup",
        "agent",
        "scale",
        "elastic",
        "hosts",
        "slurm",
        "workloads",
        "sharded",
        "group_start",
        "data_cache",
        "state_scale",
    ):
        res = results.get(scenario)
        if not res:
            continue
        if scenario == "elastic":  # its rows are in bench/elastic_rows.py (imports this)
            from bench.elastic_rows import elastic_rows

            rows += elastic_rows(res)
        elif scenario == "hosts":  # and these in bench/hosts_rows.py
            from bench.hosts_rows import hosts_rows

            rows += hosts_rows(res)
        elif scenario == "slurm":  # and these in bench/slurm_rows.py
            from bench.slurm_rows import slurm_rows

            rows += slurm_rows(res)
        elif scenario == "workloads":  # and these in bench/workloads_rows.py
            from bench.workloads_rows import workloads_rows

            rows += workloads_rows(res)
        elif scenario == "sharded":  # and these in bench/sharded_rows.py
            from bench.sharded_rows import sharded_rows

            rows += sharded_rows(res)
        elif scenario == "group_start":  # and these in bench/group_start.py
            from bench.group_start import rows as group_start_rows

            rows += group_start_rows(res)
        elif scenario == "data_cache":  # and these in bench/data_cache.py
            from bench.data_cache import rows as data_cache_rows

            rows += data_cache_rows(res)
        elif scenario == "state_scale":  # and these in bench/state_scale_rows.py
            from bench.state_scale_rows import rows as state_scale_rows

            rows += state_scale_rows(res)
        elif scenario in _FAULT_METRICS:
            rows += fault_rows(scenario, res)
        elif scenario == "checkpoint":
            rows += checkpoint_rows(res)
        elif scenario == "agent":
            rows += agent_rows(res)
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
        "| nodes (x8 ranks) | assign + start all | fault -> decision (first /stop) "
        "| fault -> last /stop "
        "| stop broadcast | status poll cycle | controller memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def opt(f: dict[str, Any], key: str, fmt: Fmt) -> str:
        value = f.get(key)
        return "—" if value is None else fmt(value)

    for n in sorted(res["trainguard"], key=int):
        f = res["trainguard"][n]
        lines.append(
            f"| {n} | {seconds(f['start_s'])} | {_decision(f)} "
            f"| {seconds(f['stop_s'])} | {seconds(f['stop_broadcast_s'])} "
            f"| {opt(f, 'poll_cycle_s', seconds)} "
            f"| +{f['controller_rss_mib']:.0f} MiB (peak {f['controller_rss_peak_mib']:.0f} MiB) |"
        )
    for n, why in sorted((res.get("failed") or {}).items(), key=lambda item: int(item[0])):
        lines.append(f"| {n} | failed: {why} | | | | | |")
    sizes = sorted(res["trainguard"], key=int)
    notes = []
    goals = res.get("goals") or {}
    to_goal = res.get("growth_exponent_to_goal")
    if to_goal:
        notes.append(f"{sizes[0]} -> {goals.get('nodes')} nodes: {_exponents(to_goal)}")
    growth = res.get("growth_exponent") or {}
    if growth and len(sizes) > 1:
        notes.append(f"{sizes[0]} -> {sizes[-1]} nodes: {_exponents(growth)}")
    if notes:
        limit = goals.get("growth_exponent")
        goal = f"; goal: at most N^{limit:.2f}" if limit else ""
        lines += ["", f"Growth (1.00 = linear{goal}): " + "; ".join(notes) + "."]
    return "\n".join(lines)


def _decision(f: dict[str, Any]) -> str:
    """The Fault event's time after the failure, and the first ``/stop``'s (in brackets)."""
    if f.get("detect_s") is None:
        return "—"
    first = f.get("first_stop_s")
    text = _ms_or_s(f["detect_s"])
    return text if first is None else f"{text} ({_ms_or_s(first)})"


def _ms_or_s(v: float) -> str:
    return millis(v) if abs(v) < 1 else seconds(v)


def _exponents(growth: dict[str, float | None]) -> str:
    return ", ".join(f"{k} N^{v:.2f}" for k, v in growth.items() if v is not None)


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"
