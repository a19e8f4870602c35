"""``trainguard report JOB``: one self-contained HTML page about a job, and a PNG of its
main figure (the step over time, faults marked, recovery shaded by restart scope).

Everything comes from the job's history in the store (:func:`load_history`), so a
report works while the job runs (its end is "now") and after. Goodput and downtime are
:func:`~trainguard.observe.account.account`'s, the same function ``describe -o json``
uses; the page carries goodput's exact value in ``<span id="goodput" data-value=...>``.

The page needs nothing else: inline CSS, the figures as base64 PNG, no script, no URL.
Every string that comes from the job (its name, fault messages, node names, event
data) is escaped.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainguard.control.events import Event, EventKind
from trainguard.observe.account import OTHER, STARTUP, Accounting, account
from trainguard.observe.cause import failure_cause
from trainguard.observe.durable import durable_state
from trainguard.observe.figures import (
    FAULT_COLOR,
    USEFUL_COLOR,
    Png,
    cause_color,
    pace_figure,
    progress_figure,
    span_color,
    time_unit,
)
from trainguard.observe.history import JobHistory, load_history
from trainguard.observe.page import Html, cell, chip, document, esc, facts, img, table
from trainguard.platform.store import Store
from trainguard.platform.views import dash, effective_phase, stamp

__all__ = ["Report", "png_path", "render", "report_command", "why_failed", "write"]

MAX_RANK_ROWS = 16
"""The per-rank table shows this many ranks, slowest first."""


@dataclass(frozen=True)
class Report:
    html: str
    figure: Png  # the main figure, also embedded in the page
    accounting: Accounting


def render(history: JobHistory, now: float, *, world_size: int | None = None) -> Report:
    """The report of ``history`` as of ``now`` (the end of a job still running)."""
    acc = account(history, now)
    figure = progress_figure(history, acc)
    paces = pace_figure(history, acc)
    sections = [
        _header(history, acc, now, world_size),
        _time_section(acc),
        _progress_section(figure, acc),
        _fault_section(history, acc),
        _pace_section(history, paces),
        _checkpoint_section(history.events, acc),
        _attempt_section(history, acc),
    ]
    page = document(f"trainguard report: {history.name}", "\n".join(sections), stamp(now))
    return Report(page, figure, acc)


def png_path(html_path: Path) -> Path:
    """The main figure's file: beside the page, with the same stem."""
    png = html_path.with_suffix(".png")
    return png if png != html_path else html_path.with_name(html_path.name + ".png")


def write(report: Report, html_path: Path) -> Path:
    """Write the page and its PNG (each replaced whole); returns the PNG's path."""
    png = png_path(html_path)
    _replace(html_path, report.html.encode())
    _replace(png, report.figure.data)
    return png


def report_command(store: Store, ref: str, output: str | None) -> int:
    """The ``report`` verb: write the files and print their paths."""
    job = store.job(ref)
    history = replace(load_history(store, job.id), phase=effective_phase(job))
    report = render(history, time.time(), world_size=job.nnodes * job.nproc_per_node)
    html_path = Path(output) if output else Path(f"{_file_name(job.id)}-report.html")
    png = write(report, html_path)
    print(html_path)
    print(png)
    return 0


# -- sections ----------------------------------------------------------------------------


def _header(history: JobHistory, acc: Accounting, now: float, world_size: int | None) -> str:
    running = history.finished_at is None
    goodput = acc.goodput
    value = "" if goodput is None else repr(goodput)
    shown = "-" if goodput is None else f"{goodput:.1%}"
    known = [
        ("Job", history.job_id),
        ("Phase", history.phase),
        ("Started", stamp(history.started_at)),
        ("Finished", f"running (as of {stamp(now)})" if running else stamp(history.finished_at)),
        ("Duration", _duration(acc.wall_seconds)),
        ("World size", "-" if world_size is None else str(world_size)),
        ("Restarts", str(history.restarts)),
        ("Attempts", str(len(history.attempts))),
    ]
    cards = [
        ("Goodput", Html(f'<span id="goodput" data-value="{esc(value)}">{esc(shown)}</span>')),
        ("Useful time", _duration(acc.useful_seconds)),
        ("Downtime", _duration(acc.wall_seconds - acc.useful_seconds)),
        ("Faults", str(len(history.faults))),
        ("Steps kept", str(acc.kept_steps)),
        ("Steps lost", str(acc.lost_steps)),
    ]
    why = why_failed(history)
    return (
        f"<header><h1>{esc(history.name)}</h1>"
        f'<p class="sub">trainguard job report</p></header>\n'
        + (
            f'<p id="why" style="border-left:4px solid {FAULT_COLOR};padding:4px 10px">'
            f'<b>Why it failed:</b> <span class="msg">{esc(why)}</span></p>\n'
            if why
            else ""
        )
        + facts(known)
        + '<div class="cards">'
        + "".join(
            f'<div class="card"><div>{cell(v)}</div><small>{esc(k)}</small></div>' for k, v in cards
        )
        + "</div>"
    )


def why_failed(history: JobHistory) -> str | None:
    """A failed job's reason, as its controller recorded it when it gave up (the fault,
    with the failed rank's exception where it wrote one, and the exhausted budget),
    after the fault that started the failure where that was another one (a host that
    went silent: :mod:`trainguard.observe.cause`)."""
    if history.phase != "Failed":
        return None
    return failure_cause([e for e in history.events if e.kind != EventKind.JOB_FAILED or e.message])


def _time_section(acc: Accounting) -> str:
    wall = acc.wall_seconds
    downtime = {c: s for c, s in acc.downtime_seconds().items() if s > 0}
    causes = list(downtime)
    parts = [("useful", acc.useful_seconds, USEFUL_COLOR)]
    order = sorted(downtime, key=lambda c: (c == OTHER, c != STARTUP, -downtime[c]))
    parts += [(c, downtime[c], cause_color(c, causes)) for c in order]
    bar = ""
    if wall > 0:
        bar = (
            '<div class="bar">'
            + "".join(
                f'<span style="width:{100 * s / wall:.3f}%;background:{color}" '
                f'title="{esc(name)}: {s:.1f} s"></span>'
                for name, s, color in parts
                if s > 0
            )
            + "</div>"
        )
    rows = [
        [chip(color), name, f"{s:.1f} s", f"{s / wall:.1%}" if wall > 0 else "-"]
        for name, s, color in parts
    ]
    rows.append(["", Html("<b>wall</b>"), f"{wall:.1f} s", "100%" if wall > 0 else "-"])
    note = (
        "Useful time is time spent on steps that were kept; downtime is every other stretch, "
        "by the fault that caused it (<i>startup</i>: before the first step; <i>other</i>: "
        "the rest, e.g. the final save and shutdown)."
    )
    return (
        f"<section><h2>Where the time went</h2>{bar}"
        + table(["", "", "seconds", "share"], rows, "narrow")
        + f'<p class="note">{note}</p></section>'
    )


def _progress_section(figure: Png, acc: Accounting) -> str:
    unit, name = time_unit(acc.wall_seconds)
    rows = [
        [
            chip(span_color(d.cause, d.scope)),
            _since(d.start, acc, unit, name),
            _since(d.end, acc, unit, name),
            f"{d.seconds:.1f} s",
            d.cause,
            d.scope or "-",
            dash(d.attempt),
        ]
        for d in acc.downtime
    ]
    intervals = (
        "<h3>Downtime intervals</h3>"
        + table(["", "from", "to", "seconds", "cause", "restart scope", "attempt"], rows)
        if rows
        else ""
    )
    return (
        "<section><h2>Progress</h2>"
        + img(figure, "the step over time, faults marked, recovery shaded")
        + intervals
        + "</section>"
    )


def _fault_section(history: JobHistory, acc: Accounting) -> str:
    if not history.faults:
        return '<section><h2>Faults</h2><p class="none">No faults.</p></section>'
    unit, name = time_unit(acc.wall_seconds)
    rows = []
    for f in history.faults:
        detected = f.get("detected_at", f.get("time"))
        evidence = f.get("evidence") or {}
        injected = evidence.get("injected") if isinstance(evidence, Mapping) else None
        recovery = f.get("recovery_seconds")
        rows.append(
            [
                Html(
                    f"{esc(_since(detected, acc, unit, name))}"
                    f"<br><small>{esc(stamp(detected))}</small>"
                )
                if isinstance(detected, int | float)
                else "-",
                Html(f'<b style="color:{FAULT_COLOR}">{esc(f.get("type", "-"))}</b>'),
                f"yes ({injected})" if isinstance(injected, str) else ("yes" if injected else "no"),
                dash(f.get("attempt")),
                dash(f.get("node")),
                dash(f.get("rank")),
                dash(f.get("fault_step", f.get("step"))),
                dash(f.get("resumed_step")),
                dash(f.get("scope")),
                f"{recovery:.2f}" if isinstance(recovery, int | float) else "-",
                dash(f.get("lost_steps")),
                Html(f'<span class="msg">{esc(f.get("message", ""))}</span>'),
            ]
        )
    head = ["detected", "type", "injected", "attempt", "node", "rank", "step", "resumed from"]
    head += ["scope"]
    head += ["recovery s", "lost steps", "message"]
    stacks = "".join(_stacks(f) for f in history.faults)
    return "<section><h2>Faults</h2>" + table(head, rows, "faults") + stacks + "</section>"


def _stacks(fault: Mapping[str, Any]) -> str:
    """The stacks captured for a hang, one folded block per rank."""
    evidence = fault.get("evidence")
    stacks = evidence.get("stacks") if isinstance(evidence, Mapping) else None
    if not isinstance(stacks, Mapping):
        return ""
    out = []
    for rank, text in sorted(stacks.items(), key=lambda kv: str(kv[0])):
        summary = (
            f"Stacks of rank {rank} ({fault.get('type', '-')}, attempt {fault.get('attempt')})"
        )
        out.append(
            f"<details><summary>{esc(summary)}</summary><pre>{esc(str(text))}</pre></details>"
        )
    return "".join(out)


def _pace_section(history: JobHistory, figure: Png | None) -> str:
    stragglers = [e for e in history.events if e.kind == EventKind.STRAGGLER]
    out = "<section><h2>Step time per rank</h2>"
    if figure is None:
        out += (
            '<p class="none">No per-rank step times were recorded for this job (they come '
            "from the ranks' progress lines or heartbeats, every few seconds).</p>"
        )
    else:
        out += img(figure, "seconds per step of each rank")
        by_rank: dict[int, list[float]] = defaultdict(list)
        for s in history.paces():
            by_rank[s.rank].append(s.value)
        medians = {r: statistics.median(v) for r, v in by_rank.items()}
        job = statistics.median(medians.values())
        slowest = sorted(medians, key=lambda r: -medians[r])[:MAX_RANK_ROWS]
        rows = [
            [
                str(r),
                f"{medians[r]:.4f}",
                f"{max(by_rank[r]):.4f}",
                f"{medians[r] / job:.2f}x" if job > 0 else "-",
            ]
            for r in slowest
        ]
        shown = "" if len(medians) <= MAX_RANK_ROWS else f" ({MAX_RANK_ROWS} slowest shown)"
        out += f"<h3>Ranks by median step time{shown}</h3>" + table(
            ["rank", "median s/step", "max s/step", "vs the job's median"], rows, "narrow"
        )
    if stragglers:
        rows = [
            [stamp(e.time), dash(e.attempt), dash(e.rank), dash(e.node), e.message]
            for e in stragglers
        ]
        out += "<h3>Stragglers</h3>" + table(["time", "attempt", "rank", "node", "message"], rows)
    return out + "</section>"


def _checkpoint_section(events: Sequence[Event], acc: Accounting) -> str:
    saves: dict[str, list[Event]] = defaultdict(list)
    seen: set[tuple[str, object]] = set()
    for e in events:
        if e.kind not in (EventKind.CHECKPOINT_SAVED, EventKind.CHECKPOINT_COMMITTED):
            continue
        default = "memory" if e.kind == EventKind.CHECKPOINT_SAVED else "durable"
        tier = str(e.data.get("tier") or default)
        key = (tier, e.data.get("step"))
        if e.kind == EventKind.CHECKPOINT_COMMITTED and key in seen:
            continue  # the controller's and rank 0's note of one commit
        seen.add(key)
        saves[tier].append(e)
    restores: dict[tuple[Any, str, Any], list[Event]] = defaultdict(list)
    for e in events:
        if e.kind == EventKind.CHECKPOINT_RESTORED:
            restores[e.attempt, str(e.data.get("tier", "-")), e.data.get("step")].append(e)
    failed = [e for e in events if e.kind == EventKind.CHECKPOINT_PERSIST_FAILED]
    out = "<section><h2>Checkpoints</h2>"
    if not saves and not restores and not failed:
        return out + '<p class="none">No checkpoint saves or restores were recorded.</p></section>'
    durable = durable_state(events)
    style = ""
    if durable.missing:  # marked as the page marks why a job failed
        style = f' style="border-left:4px solid {FAULT_COLOR};padding:4px 10px"'
    out += f'<p id="durable"{style}><b>Newest durable step:</b> {esc(durable.line())}</p>'
    unit, name = time_unit(acc.wall_seconds)
    if saves:
        rows = []
        for tier, group in sorted(saves.items()):
            steps = [s for s in (e.data.get("step") for e in group) if isinstance(s, int)]
            blocking = [
                float(b)
                for e in group
                for b in e.data.get("blocking_seconds") or ()
                if isinstance(b, int | float)
            ]
            rows.append(
                [
                    tier,
                    str(len(group)),
                    _steps(steps),
                    f"{statistics.median(blocking):.3f} / {max(blocking):.3f}" if blocking else "-",
                    _since(group[-1].time, acc, unit, name),
                ]
            )
        head = ["tier", "saves", "steps", "blocking s (median / max)", "last"]
        out += "<h3>Saves by tier</h3>" + table(head, rows, "narrow")
    else:
        out += '<p class="none">No checkpoint saves were recorded.</p>'
    if restores:
        rows = []
        for (attempt, tier, step), group in sorted(
            restores.items(), key=lambda kv: min(e.time for e in kv[1])
        ):
            seconds = [
                float(s) for e in group if isinstance(s := e.data.get("seconds"), int | float)
            ]
            rows.append(
                [
                    _since(min(e.time for e in group), acc, unit, name),
                    dash(attempt),
                    tier,
                    dash(step),
                    str(len({e.rank for e in group})),
                    f"{statistics.median(seconds):.3f} / {max(seconds):.3f}" if seconds else "-",
                ]
            )
        head = ["time", "attempt", "tier", "step", "ranks", "seconds (median / max)"]
        out += "<h3>Restores</h3>" + table(head, rows, "narrow")
    else:
        out += '<p class="none">No checkpoint restores were recorded.</p>'
    if failed:
        rows = [[_since(e.time, acc, unit, name), e.message] for e in failed]
        out += "<h3>Persist failures</h3>" + table(["time", "message"], rows)
    return out + "</section>"


def _attempt_section(history: JobHistory, acc: Accounting) -> str:
    if not history.attempts:
        return ""
    unit, name = time_unit(acc.wall_seconds)
    rows = [
        [
            str(a.number),
            a.phase,
            _since(a.started_at, acc, unit, name),
            "-" if a.ended_at is None else _since(a.ended_at, acc, unit, name),
            a.reason or "-",
        ]
        for a in history.attempts
    ]
    return (
        "<section><h2>Attempts</h2>"
        + table(["#", "phase", "started", "ended", "reason"], rows)
        + "</section>"
    )


# -- pieces ------------------------------------------------------------------------------


def _steps(steps: Sequence[int]) -> str:
    if not steps:
        return "-"
    shown = ", ".join(map(str, steps[-8:]))
    return shown if len(steps) <= 8 else f"..., {shown}"


def _since(t: float, acc: Accounting, unit: float, name: str) -> str:
    return f"+{(t - acc.start) / unit:.1f} {name}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "job"


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
