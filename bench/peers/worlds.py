"""The world size a peer trained at after the fault, from its ``worlds.txt``.

``_workload.Records`` appends ``<incarnation> <world> <end time>`` for every recorded
step; pure functions here (tested without any peer installed), and the one
adjustment torchft's step records need (:func:`absorbed_steps`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.steps import StepRecord, parse_lines


def read_worlds(path: Path) -> list[tuple[str, int, float]]:
    """The (incarnation, world, time) lines in file order; torn or foreign lines skipped."""
    return parse_lines(path, 3, lambda p: (p[0], int(p[1]), float(p[2])))


def world_after(
    path: Path, fault_at: float | None, stall_s: float | None, full: int
) -> dict[str, Any]:
    """``world_after``: the world of the step that ended the stall (the first completed
    by a later incarnation, ``fault_at + stall_s``); ``world_restored_s``: fault -> the
    first step at ``full`` from then on (0 when that step was at ``full``; None when the
    world never came back or nothing recovered)."""
    worlds = read_worlds(path)
    if fault_at is None or stall_s is None or not worlds:
        return {"world_after": None, "world_restored_s": None}
    recovered_at = fault_at + stall_s - 1e-3  # the records keep microseconds
    after = sorted((t, w) for _, w, t in worlds if t >= recovered_at)
    if not after:
        return {"world_after": None, "world_restored_s": None}
    first = after[0][1]
    if first == full:
        restored: float | None = 0.0
    else:
        restored = next((t - fault_at for t, w in after if w == full), None)
    return {"world_after": first, "world_restored_s": restored}


def absorbed_steps(records: list[StepRecord], fault_at: float | None) -> list[StepRecord]:
    """The records with a step that *absorbed* the fault counted as after it.

    A torchft step starts its quorum before the kill and can end, in a new membership
    without the dead replica, after it: it ran through the fault rather than before it.
    ``bench.steps.recovery_after`` picks the faulted incarnation from the steps started
    before the fault, which would make that new membership the faulted one (and find no
    recovery). Here a step that ended after the fault in another incarnation than the
    last step ended before it starts just after the fault; the stall then ends with it.
    """
    if fault_at is None:
        return records
    done = [r for r in records if r.end <= fault_at]
    if not done:
        return records
    faulted = max(done, key=lambda r: r.end).incarnation
    return [
        replace(r, start=fault_at + 1e-6)
        if r.start <= fault_at < r.end and r.incarnation != faulted
        else r
        for r in records
    ]
