"""Where a goodput window's time goes: useful steps, and each kind of loss.

``W - useful`` is split into parts that add up (``other`` is the remainder: the window's
edges, overlaps), judged from rank 0's step records, the kills, and the launcher's
fault decisions (trainguard's ``Fault`` events; a baseline without them has its
detection inside the stall):

- ``start-up``: launch -> the first step starts;
- ``detection``: kill (or the last step completed after it) -> the launcher's fault
  decision;
- ``stall``: the decision -> the first step of the incarnation that follows the fault
  starts;
- ``redone steps``: steps completed, lost to a fault, and completed again;
- ``between steps``: gaps between one step's end and the next one's start outside any
  stall (checkpoint saves, the step record, the script's loop);
- ``other``: the rest.

A slow kept step counts as useful in goodput; what the steps after each recovery took
beyond the median step is reported beside (``slow steps after recovery``, not a part).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from bench.steps import StepRecord

PARTS = ("start-up", "detection", "stall", "redone steps", "between steps", "other")
SETTLE_S = 5.0
"""How long after a recovery its steps count as recovering (the slow-steps figure)."""


def breakdown(
    records: Sequence[StepRecord],
    start: float,
    end: float,
    kills: Sequence[float],
    decisions: Sequence[float] = (),
) -> dict[str, float]:
    """Seconds of the window ``[start, end]`` by part, plus ``useful``, ``window`` and
    ``slow steps after recovery`` (see the module docstring)."""
    window = sorted(
        (r for r in records if start <= r.start and r.end <= end), key=lambda r: r.start
    )
    parts = dict.fromkeys(PARTS, 0.0)
    if not window:
        parts["other"] = end - start
        return {"window": end - start, "useful": 0.0, **parts, "slow steps after recovery": 0.0}
    kept: dict[int, StepRecord] = {}
    for r in sorted(window, key=lambda r: r.end):
        kept[r.step] = r
    useful = sum(r.end - r.start for r in kept.values())
    parts["redone steps"] = sum(r.end - r.start for r in window if kept[r.step] is not r)
    parts["start-up"] = window[0].start - start
    median = statistics.median(r.end - r.start for r in kept.values())
    stalls: list[tuple[float, float]] = []
    slow = 0.0
    for kill in sorted(kills):
        before = [r for r in window if r.end <= kill]
        old = before[-1].incarnation if before else None
        resume = next((r for r in window if r.start >= kill and r.incarnation != old), None)
        if resume is None:
            continue
        # Steps the old incarnation completed after the kill are steps (redone or kept).
        quiet_from = max([kill, *(r.end for r in window if r.end <= resume.start)])
        decision = next((d for d in sorted(decisions) if d >= kill), None)
        detection = 0.0 if decision is None else max(0.0, min(decision, resume.start) - quiet_from)
        parts["detection"] += detection
        parts["stall"] += resume.start - quiet_from - detection
        stalls.append((quiet_from, resume.start))
        slow += sum(
            max(0.0, (r.end - r.start) - median)
            for r in window
            if r.incarnation == resume.incarnation and r.start <= resume.start + SETTLE_S
        )
    for a, b in itertools.pairwise(window):
        gap = b.start - a.end
        if gap > 0 and not any(s < b.start and a.end < e for s, e in stalls):
            parts["between steps"] += gap
    parts["other"] = (end - start) - useful - sum(v for k, v in parts.items() if k != "other")
    return {"window": end - start, "useful": useful, **parts, "slow steps after recovery": slow}
