"""Plain values for the controller's tests: node reports as the platform would give them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainguard.control.actions import StartNodes
from trainguard.control.controller import JobController
from trainguard.control.reports import NodeReport
from trainguard.wire.status import (
    Beat,
    CheckpointStatus,
    Detection,
    MonitorSnapshot,
    NodeState,
    NodeStatus,
    Progress,
    RuleActivity,
    WorkerEvent,
    WorkerState,
    WorkerStatus,
)

NPROC = 2


def workers(
    node_rank: int,
    state: WorkerState = WorkerState.RUNNING,
    nproc: int = NPROC,
    **per_rank: WorkerStatus,
) -> tuple[WorkerStatus, ...]:
    """A node's workers, all in ``state``; ``r3=WorkerStatus(...)`` replaces rank 3's."""
    out = []
    for local in range(nproc):
        rank = node_rank * nproc + local
        worker = per_rank.get(f"r{rank}")
        if worker is None:
            worker = WorkerStatus(local_rank=local, rank=rank, pid=1000 + rank, state=state)
        out.append(worker)
    return tuple(out)


def failed_worker(
    rank: int,
    exitcode: int = -9,
    signal: str | None = "SIGKILL",
    error: str | None = None,
    nproc: int = NPROC,
) -> WorkerStatus:
    return WorkerStatus(
        local_rank=rank % nproc,
        rank=rank,
        pid=1000 + rank,
        state=WorkerState.FAILED,
        exitcode=exitcode,
        signal=signal,
        error=error,
    )


def status(
    node: str,
    state: NodeState | str = NodeState.RUNNING,
    attempt: int | None = 0,
    *,
    reason: str | None = None,
    workers: Sequence[WorkerStatus] = (),
    progress: Progress | None = None,
    rules: Mapping[str, RuleActivity] | None = None,
    detections: Iterable[Detection] = (),
    heartbeats: Mapping[int, float] | None = None,
    stacks: Mapping[int, str] | None = None,
    events: Iterable[WorkerEvent] = (),
    checkpoint: CheckpointStatus | None = None,
    seq: int = 0,
) -> NodeStatus:
    return NodeStatus(
        node_id=node,
        incarnation=node,
        pid=1,
        seq=seq,
        state=NodeState(state),
        attempt=attempt,
        reason=reason,
        updated_at=0.0,
        workers=tuple(workers),
        monitor=MonitorSnapshot(
            rules=dict(rules or {}),
            progress=progress,
            detections=tuple(detections),
        ),
        heartbeats={r: Beat(time=t) for r, t in (heartbeats or {}).items()},
        stacks=dict(stacks or {}),
        events=tuple(events),
        checkpoint=checkpoint or CheckpointStatus(),
    )


def report(
    node: str, state: NodeState | str = NodeState.RUNNING, attempt: int | None = 0, **kw: Any
) -> NodeReport:
    """An up node whose agent reports ``state`` about ``attempt``."""
    return NodeReport(node, status(node, state, attempt, **kw))


def reports(
    nodes: Sequence[str],
    state: NodeState | str = NodeState.RUNNING,
    attempt: int | None = 0,
    **per_node: NodeReport,
) -> dict[str, NodeReport]:
    """Every node in ``state`` about ``attempt`` (with its workers); ``per_node`` overrides."""
    running = NodeState(state) in (NodeState.RUNNING, NodeState.STARTING)
    base = {
        n: report(
            n,
            state,
            attempt,
            workers=workers(i, WorkerState.RUNNING if running else WorkerState.SUCCEEDED),
        )
        for i, n in enumerate(nodes)
    }
    base.update(per_node)
    return base


def crashed(
    node: str,
    rank: int,
    attempt: int = 0,
    *,
    exitcode: int = -9,
    signal: str | None = "SIGKILL",
    error: str | None = None,
    reason: str | None = "boom",
    peers: WorkerState = WorkerState.RUNNING,
) -> NodeReport:
    """A node that reports ``rank`` failed, its other workers in ``peers`` (reported at
    once, they still run; after a stop, they have been stopped)."""
    node_rank = rank // NPROC
    failed = failed_worker(rank, exitcode, signal, error)
    return report(
        node,
        NodeState.FAULTED,
        attempt,
        reason=reason,
        workers=workers(node_rank, peers, **{f"r{rank}": failed}),
    )


def lost(node: str, why: str = "its agent process exited with code -9") -> NodeReport:
    """A node the platform knows is gone."""
    return NodeReport(node, gone=why)


def ready(nodes: Sequence[str]) -> dict[str, NodeReport]:
    """Freshly launched agents, idle."""
    return {n: report(n, NodeState.READY, None) for n in nodes}


def begin(c: JobController, now: float = 0.0) -> StartNodes:
    """Start the job and bring its nodes up: the first attempt's StartNodes."""
    c.start(now)
    [start] = c.observe(now, ready(c.nodes))
    assert isinstance(start, StartNodes), start
    return start
