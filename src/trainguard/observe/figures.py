"""The figures of ``trainguard report``, drawn with matplotlib's Agg backend.

No pyplot: each figure is a :class:`matplotlib.figure.Figure` on its own Agg canvas, so
nothing global is set and nothing needs a display. matplotlib is imported inside the
functions (it takes a while to import, and only ``report`` needs it); the colours are
plain constants the HTML uses too.

Times are seconds since the job's start (minutes or hours for long jobs: see
:func:`time_unit`). Strings from the job are drawn with ``parse_math=False`` (a ``$``
in a job name is text, not TeX).
"""

from __future__ import annotations

import io
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainguard.control.events import EventKind
from trainguard.observe.account import OTHER, STARTUP, Accounting
from trainguard.observe.history import PACE_INTERVAL, JobHistory, SeriesSample

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "FAULT_COLOR",
    "SCOPE_COLORS",
    "Png",
    "cause_color",
    "pace_figure",
    "progress_figure",
    "span_color",
    "time_unit",
]

STEP_COLOR = "#1f77b4"
LOST_COLOR = "#9fb7cc"  # steps done again by a later attempt
FAULT_COLOR = "#d62728"  # the fault markers (nothing else in the main figure is red)
COMMIT_COLOR = "#17becf"
USEFUL_COLOR = "#59a14f"
SCOPE_COLORS = {"process": "#f28e2b", "job": "#9467bd", "inprocess": "#2ca9a1"}
NO_RESTART_COLOR = "#bab0ac"  # downtime after a fault that no restart followed
STARTUP_COLOR = "#c7c7c7"
OTHER_COLOR = "#e4e4e4"
_CAUSE_PALETTE = ("#e15759", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#76b7b2", "#4e79a7")
MAX_RANK_LINES = 16
"""More ranks than this: the per-rank figure is a heatmap."""
MAX_HEATMAP_COLUMNS = 600
"""Time bins of the per-rank heatmap, at most."""
MAX_FAULT_LABELS = 24
"""More faults than this: their markers are drawn without a label each."""
DPI = 100


@dataclass(frozen=True)
class Png:
    """A rendered figure and where its data went in pixels.

    ``axes``: the plot area as ``(left, top, right, bottom)`` pixels of the image (top
    row 0); ``xlim``: the time range it shows, in units of ``unit`` seconds since the
    job's start; ``fault_x``: the pixel column of each fault marker.
    """

    data: bytes
    width: int
    height: int
    axes: tuple[float, float, float, float]
    xlim: tuple[float, float]
    unit: float
    fault_x: tuple[float, ...] = ()


def time_unit(seconds: float) -> tuple[float, str]:
    """Seconds per unit and its name, for a time axis ``seconds`` long."""
    if seconds >= 3 * 3600:
        return 3600.0, "h"
    if seconds >= 15 * 60:
        return 60.0, "min"
    return 1.0, "s"


def span_color(cause: str, scope: str | None) -> str:
    """The shade of a downtime interval in the figures: its restart's scope."""
    if scope is not None:
        return SCOPE_COLORS.get(scope, NO_RESTART_COLOR)
    if cause == STARTUP:
        return STARTUP_COLOR
    return OTHER_COLOR if cause == OTHER else NO_RESTART_COLOR


def cause_color(cause: str, causes: Sequence[str]) -> str:
    """The colour of a downtime cause in the report's bar (``causes``: all of them)."""
    if cause == STARTUP:
        return STARTUP_COLOR
    if cause == OTHER:
        return OTHER_COLOR
    faults = sorted(c for c in causes if c not in (STARTUP, OTHER))
    return _CAUSE_PALETTE[faults.index(cause) % len(_CAUSE_PALETTE)] if cause in faults else "#888"


def progress_figure(
    history: JobHistory, acc: Accounting, *, width: float = 11.0, height: float = 4.6
) -> Png:
    """The main figure: the step over time, each fault a red line at its detection, the
    downtime shaded by its restart's scope, steps done again drawn faded."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig, ax = _figure(width, height)
    unit, unit_name = time_unit(acc.wall_seconds)
    t0 = acc.start

    def x(t: float) -> float:
        return (t - t0) / unit

    shades: dict[str, str] = {}
    for d in acc.downtime:
        color = span_color(d.cause, d.scope)
        ax.axvspan(x(d.start), x(d.end), color=color, alpha=0.45, lw=0, zorder=0)
        shades.setdefault(_shade_label(d.cause, d.scope), color)

    kept_to = {u.attempt: u.last for u in acc.useful}
    top = 0.0
    drew_lost = False
    for attempt, samples in sorted(_by_attempt(history.progress()).items()):
        times = [x(s.time) for s in samples]
        steps = [s.value for s in samples]
        top = max(top, *steps)
        last = kept_to.get(attempt)
        n_kept = sum(1 for v in steps if last is not None and v <= last)
        if n_kept:
            ax.plot(times[:n_kept], steps[:n_kept], color=STEP_COLOR, lw=1.8, zorder=3)
        if n_kept < len(steps):
            i = max(0, n_kept - 1)
            ax.plot(times[i:], steps[i:], color=LOST_COLOR, lw=1.6, ls="--", zorder=2)
            drew_lost = True

    commits = _commits(history)
    if commits:
        ax.plot(
            [x(t) for t, _ in commits],
            [s for _, s in commits],
            ls="none",
            marker="v",
            ms=5,
            color=COMMIT_COLOR,
            zorder=4,
        )
        top = max(top, *(s for _, s in commits))

    faults = [f for f in history.faults if _fault_time(f) is not None]
    xmax = max(x(acc.end), 1e-9)
    ax.set_xlim(0.0, xmax)
    ax.set_ylim(0.0, max(top, 1.0) * 1.08)
    for f in faults:
        t = x(_fault_time(f) or t0)
        ax.axvline(t, color=FAULT_COLOR, lw=1.6, zorder=5)
        step = f.get("fault_step", f.get("step"))
        if isinstance(step, int | float):
            ax.plot([t], [step], marker="x", ms=7, mew=2, color=FAULT_COLOR, zorder=6)
        if len(faults) <= MAX_FAULT_LABELS:
            ax.text(
                t,
                0.98,
                f" {f.get('type', 'fault')}",
                transform=ax.get_xaxis_transform(),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
                color=FAULT_COLOR,
                parse_math=False,
                zorder=6,
            )

    if not history.progress():
        ax.text(
            0.5, 0.5, "no progress recorded yet", transform=ax.transAxes, ha="center", color="#666"
        )
    ax.set_xlabel(f"time since the job started ({unit_name})")
    ax.set_ylabel("step")
    ax.set_title(f"{history.name}: step over time", loc="left", fontsize=11, parse_math=False)
    ax.grid(True, color="#eeeeee", zorder=1)
    handles: list[Any] = [Line2D([], [], color=STEP_COLOR, lw=1.8, label="kept steps")]
    if drew_lost:
        handles.append(Line2D([], [], color=LOST_COLOR, lw=1.6, ls="--", label="steps lost"))
    if faults:
        handles.append(Line2D([], [], color=FAULT_COLOR, lw=1.6, label="fault detected"))
    if commits:
        handles.append(
            Line2D([], [], color=COMMIT_COLOR, ls="none", marker="v", label="durable checkpoint")
        )
    handles += [Patch(color=c, alpha=0.45, label=label) for label, c in shades.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _render(fig, ax, (0.0, xmax), unit, [x(_fault_time(f) or t0) for f in faults])


def pace_figure(
    history: JobHistory, acc: Accounting, *, width: float = 11.0, height: float = 4.0
) -> Png | None:
    """Each rank's seconds per step over time: a line per rank, or a heatmap of each
    rank's pace relative to the job's median when there are many ranks; None without
    pace samples."""
    paces = history.paces()
    if not paces:
        return None
    fig, ax = _figure(width, height)
    unit, unit_name = time_unit(acc.wall_seconds)
    t0 = acc.start
    by_rank: dict[int, list[SeriesSample]] = defaultdict(list)
    for s in sorted(paces, key=lambda s: s.time):
        by_rank[s.rank].append(s)
    xmax = max((acc.end - t0) / unit, 1e-9)
    if len(by_rank) <= MAX_RANK_LINES:
        cmap = _colormap("tab20")
        for i, (rank, samples) in enumerate(sorted(by_rank.items())):
            times = [(s.time - t0) / unit for s in samples]
            ax.plot(
                times,
                [s.value for s in samples],
                marker=".",
                lw=1.2,
                color=cmap(i % 20),
                label=f"rank {rank}",
            )
        ax.set_ylabel("seconds per step")
        ax.set_ylim(0.0, max(s.value for s in paces) * 1.15 or 1.0)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, ncol=1)
        ax.grid(True, color="#eeeeee")
    else:
        _pace_heatmap(fig, ax, by_rank, t0, unit)
        ax.set_ylabel("rank")
    for f in history.faults:
        t = _fault_time(f)
        if t is not None:
            ax.axvline((t - t0) / unit, color=FAULT_COLOR, lw=1.0, alpha=0.6)
    ax.set_xlim(0.0, xmax)
    ax.set_xlabel(f"time since the job started ({unit_name})")
    ax.set_title("step time per rank", loc="left", fontsize=11)
    return _render(fig, ax, (0.0, xmax), unit, [])


def _pace_heatmap(
    fig: Figure, ax: Axes, by_rank: Mapping[int, Sequence[SeriesSample]], t0: float, unit: float
) -> None:
    """Ranks x recordings, each cell the rank's pace over the median of its recording
    (at most :data:`MAX_HEATMAP_COLUMNS` columns: long jobs are averaged into bins; a
    stretch without recordings, the job being down, stays blank)."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    times = sorted({s.time for samples in by_rank.values() for s in samples})
    column = {t: i for i, t in enumerate(times)}
    low, high = min(by_rank), max(by_rank)
    grid = np.full((high - low + 1, len(times)), np.nan)
    for rank, samples in by_rank.items():
        for s in samples:
            grid[rank - low, column[s.time]] = s.value
    ends = np.array(times)
    with warnings.catch_warnings():  # all-blank slices: no median, no mean (NaN is right)
        warnings.simplefilter("ignore", RuntimeWarning)
        ratio = grid / np.nanmedian(grid, axis=0)
        if len(times) > MAX_HEATMAP_COLUMNS:
            bins = np.array_split(np.arange(len(times)), MAX_HEATMAP_COLUMNS)
            ratio = np.stack([np.nanmean(ratio[:, b], axis=1) for b in bins], axis=1)
            ends = np.array([times[b[-1]] for b in bins])
    ends = (ends - t0) / unit
    width = float(np.median(np.diff(ends))) if len(ends) > 1 else PACE_INTERVAL / unit
    edges = [float(ends[0]) - width]
    columns = []
    for i, end in enumerate(ends):
        if end - width > edges[-1]:  # a gap before this recording: leave it blank
            columns.append(np.full(len(grid), np.nan))
            edges.append(float(end) - width)
        columns.append(ratio[:, i])
        edges.append(float(end))
    finite = ratio[np.isfinite(ratio)]
    image = ax.pcolormesh(
        edges,
        np.arange(low - 0.5, high + 1.0),
        np.ma.masked_invalid(np.stack(columns, axis=1)),
        cmap="RdYlBu_r",
        norm=TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=max(2.0, float(finite.max(initial=0.0)))),
        shading="flat",
    )
    fig.colorbar(image, ax=ax, label="x the median step time")


def _figure(width: float, height: float) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _render(
    fig: Figure, ax: Axes, xlim: tuple[float, float], unit: float, fault_x: Iterable[float]
) -> Png:
    """The PNG, and where the plot area and the fault markers landed in it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    # The layout of the draw savefig just did: data -> display pixels (origin bottom left).
    width, height = (round(v) for v in fig.bbox.size)
    box = ax.get_window_extent()
    columns = tuple(float(ax.transData.transform((t, 0.0))[0]) for t in fault_x)
    return Png(
        data=buffer.getvalue(),
        width=width,
        height=height,
        axes=(float(box.x0), height - float(box.y1), float(box.x1), height - float(box.y0)),
        xlim=xlim,
        unit=unit,
        fault_x=columns,
    )


def _colormap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name]


def _shade_label(cause: str, scope: str | None) -> str:
    if scope is not None:
        return f"recovery ({scope} restart)"
    if cause == STARTUP:
        return "startup"
    return "other (final save, shutdown)" if cause == OTHER else "after a fault, no restart"


def _by_attempt(samples: Iterable[SeriesSample]) -> dict[int, list[SeriesSample]]:
    """Each attempt's progress samples, oldest first, the step never going back."""
    out: dict[int, list[SeriesSample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.time):
        kept = out[s.attempt]
        if not kept or s.value > kept[-1].value:
            kept.append(s)
    return dict(out)


def _commits(history: JobHistory) -> list[tuple[float, int]]:
    """(time, step) of each durable commit, once per step."""
    seen: dict[int, float] = {}
    for e in history.events:
        step = e.data.get("step")
        if e.kind == EventKind.CHECKPOINT_COMMITTED and isinstance(step, int) and step not in seen:
            seen[step] = e.time
    return sorted((t, s) for s, t in seen.items())


def _fault_time(fault: Mapping[str, Any]) -> float | None:
    t = fault.get("detected_at", fault.get("time"))
    return float(t) if isinstance(t, int | float) else None
