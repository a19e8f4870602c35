"""``trainguard nodes JOB`` and ``trainguard node replace JOB NODE``: a local job's nodes
with their health (HyperPod's two status values), and a replacement asked for by hand.

A node's health is what the job's controller recorded last (its ``NodeHealth`` events,
:mod:`trainguard.control.health`); a node that never had one is ``Schedulable`` with no
deep check. A node left out of the job (replaced) is listed too, with ``STATE`` out.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from trainguard.control.events import EventKind
from trainguard.platform.store import JobRow, Store
from trainguard.platform.views import _table, controller_runs, effective_phase

__all__ = ["nodes", "replace", "scale"]

EXIT_USAGE = 2


def node_health(store: Store, job_id: str) -> list[dict[str, Any]]:
    """Every node of the job (current ones in node-rank order, then those that left)."""
    health: dict[str, dict[str, Any]] = {}
    for event in store.events(job_id):
        if event.kind == EventKind.NODE_HEALTH and event.node is not None:
            health[event.node] = dict(event.data)
    rows = sorted(store.nodes(job_id), key=lambda r: (r["node_rank"] is None, r["node_rank"]))
    current = {row["node_id"]: row for row in rows}
    out = []
    for node_id in [*current, *(n for n in health if n not in current)]:
        row, seen = current.get(node_id), health.get(node_id, {})
        out.append(
            {
                "node": node_id,
                "state": row["state"] if row is not None else "out",
                "nodeRank": row["node_rank"] if row is not None else None,
                "nodeHealthStatus": seen.get("status", "Schedulable"),
                "deepHealthCheckStatus": seen.get("deep"),
                "reason": seen.get("reason", ""),
            }
        )
    return out


def nodes(store: Store, ref: str, output: str) -> int:
    job = store.job(ref)
    listed = node_health(store, job.id)
    if output == "json":
        print(json.dumps({"job": job.id, "nodes": listed}, indent=2))
        return 0
    rows = [["NODE", "STATE", "HEALTH", "DEEP CHECK", "REASON"]]
    for n in listed:
        reason = n["reason"] if len(n["reason"]) <= 80 else n["reason"][:77] + "..."
        rows.append(
            [
                n["node"],
                n["state"],
                n["nodeHealthStatus"],
                n["deepHealthCheckStatus"] or "-",
                reason,
            ]
        )
    _table(rows)
    return 0


def replace(store: Store, ref: str, node_id: str, reason: str) -> int:
    """Ask the job's controller to replace ``node_id`` (like a monitor's finding)."""
    job = store.job(ref)
    if not _running(job, "replace"):
        return EXIT_USAGE
    current = {row["node_id"] for row in store.nodes(job.id)}
    if node_id not in current:
        known = ", ".join(sorted(current)) or "none yet"
        print(
            f"trainguard: job {job.id} has no node {node_id!r} (its nodes: {known})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    store.request_replace(job.id, node_id, reason)
    print(f"job {job.id}: asked to replace {node_id} ({reason})")
    return 0


def scale(store: Store, ref: str, capacity: int) -> int:
    """Set how many nodes a running elastic job may use (``trainguard scale``)."""
    job = store.job(ref)
    if not _running(job, "scale"):
        return EXIT_USAGE
    if json.loads(job.spec_json).get("spec", {}).get("elasticPolicy") is None:
        print(
            f"trainguard: job {job.id} has no spec.elasticPolicy: it runs at a fixed size",
            file=sys.stderr,
        )
        return EXIT_USAGE
    store.set_capacity(job.id, capacity)
    print(f"job {job.id}: capacity {capacity} nodes")
    return 0


def _running(job: JobRow, what: str) -> bool:
    """Whether the job's controller runs it (else says there is nothing to ``what``)."""
    if controller_runs(job) and effective_phase(job) in ("Pending", "Running", "Restarting"):
        return True
    print(f"trainguard: job {job.id} is {effective_phase(job)}: nothing to {what}", file=sys.stderr)
    return False
