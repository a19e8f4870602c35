"""The slurm scenario's rows of the summary table (results of :func:`bench.suite.slurm`).

One fault, a node's host cut off, as a fault scenario's result
(:func:`bench.table_rows.fault_rows`) under ``lost``; the one baseline is Slurm's own
recovery of the same job (killed and requeued), named for what it is. The Slurm timers
the cluster ran with are in the results' ``setup.slurm_settings`` (short ones: see
docs/benchmarks.md), and the detection rows compare different things on purpose: the cut
to trainguard's ``NodeLost`` against the cut to Slurm's requeue.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.table_rows import Fmt, Row, count, fault_rows, seconds

SCENARIO = "slurm"
BASELINE = "plain Slurm: srun torchrun, killed and requeued (short timers)"
METRICS: list[tuple[str, str, Fmt, bool]] = [
    ("stall_s", "node lost: stall: cut -> next completed step", seconds, True),
    ("lost_steps", "node lost: steps lost (redone)", count, True),
    ("detect_s", "node lost: cut -> NodeLost / Slurm's requeue", seconds, True),
]


def slurm_rows(res: dict[str, Any]) -> list[Row]:
    """The node-lost rows; one row saying why, when the scenario was skipped."""
    if "skipped" in res:
        why = f"not measured: {res['skipped']}"
        return [Row(SCENARIO, "every figure", "—", "—", "—", "—", why)]
    if "lost" not in res:
        return []
    return [replace(row, baseline=BASELINE) for row in fault_rows(SCENARIO, res["lost"], METRICS)]
