"""``trainguard resume JOB``: take a job over from a dead controller, on this machine.

:func:`recorded` reads what the dead controller left in the store; :func:`live_agents`
asks the job's agents (their URLs and pids are in the store, the job's token in its
directory) whether every one of them still runs the newest attempt. When they all do,
the new controller adopts them (:class:`AdoptedNode`: an agent process this one did not
start) and tells each where to report (``POST /attach``); otherwise it starts a new
attempt from the newest checkpoint (:mod:`trainguard.control.resume`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING
from urllib.parse import urlsplit

from trainguard.agent.client import AgentClient, AgentError
from trainguard.agent.controller_watch import start_ticks
from trainguard.control import resume as control
from trainguard.control.actions import Action, JobPhase
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.controller import JobController
from trainguard.control.events import EventKind
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.resume import Recorded, RecordedAttempt
from trainguard.platform.node import WorkerPids
from trainguard.platform.procs import kill_recorded, runs, start_time
from trainguard.platform.store import JobRow, Store
from trainguard.platform.transport import AgentTransport
from trainguard.wire.requests import AttachRequest
from trainguard.wire.status import NodeState, NodeStatus

if TYPE_CHECKING:
    from trainguard.platform.local_platform import LocalPlatform

__all__ = [
    "AdoptedNode",
    "LiveAgent",
    "live_agents",
    "live_status",
    "reattached",
    "recorded",
    "resumed_begin",
]

AGENT_SHUTDOWN_SECONDS = 30.0
_LIVE = (NodeState.STARTING, NodeState.RUNNING, NodeState.COMPLETED, NodeState.FAULTED)


def recorded(store: Store, job: JobRow) -> Recorded:
    """The attempts, restarts and faults the job's controller recorded."""
    attempts = tuple(
        RecordedAttempt(
            a["number"],
            a["phase"],
            a["started_at"],
            a["ended_at"],
            a["reason"],
            StoreEndpoint(a["master_addr"], a["master_port"])
            if a["master_addr"] and a["master_port"]
            else None,
        )
        for a in store.attempts(job.id)
    )
    restarts = tuple(
        RestartRecord(e.time, RestartScope(str(e.data["scope"])))
        for e in store.events(job.id)
        if e.kind == EventKind.RESTART_SCHEDULED and e.data.get("scope") in set(RestartScope)
    )
    return Recorded(
        job.started_at or job.created_at, attempts, restarts, tuple(json.loads(job.faults_json))
    )


@dataclass(frozen=True)
class LiveAgent:
    node_id: str
    node_rank: int
    url: str
    pid: int
    started: str | None  # the pid's start time (procs.start_time): never a reused pid
    incarnation: str


def live_agents(
    store: Store, job: JobRow, token: str, attempt: int | None
) -> tuple[list[LiveAgent], str | None]:
    """Every node agent of ``attempt`` that still runs it (in node-rank order), or the
    reason the job cannot be re-attached to (then the list is empty)."""
    if attempt is None:
        return [], "no attempt was started"
    rows = [n for n in store.nodes(job.id) if n["attempt"] == attempt and n["ranks"]]
    if len(rows) != job.nnodes:
        return [], f"{len(rows)} of {job.nnodes} nodes were recorded in attempt {attempt}"
    agents = []
    for row in sorted(rows, key=lambda r: r["node_rank"]):
        url, pid = row["agent_url"], row["agent_pid"]
        started = row.get("agent_started") or start_time(pid)
        if not url or not runs(pid, started):
            return [], f"the agent of {row['node_id']} is gone"
        status, why = live_status(url, token, row["node_id"], attempt, pid=pid)
        if status is None:
            return [], why
        agents.append(
            LiveAgent(row["node_id"], row["node_rank"], url, pid, started, status.incarnation)
        )
    return agents, None


def live_status(
    url: str,
    token: str,
    node_id: str,
    attempt: int,
    *,
    pid: int | None = None,
    incarnation: str | None = None,
    who: str | None = None,
    timeout: float = 10.0,
) -> tuple[NodeStatus | None, str | None]:
    """The status of the agent at ``url`` when it is ``node_id``'s (the very process
    ``pid``, or agent ``incarnation``, when given) and still runs ``attempt``; else None
    and why not (``who``: the node as the reason names it)."""
    who = who or node_id
    client = AgentClient(url, token, timeout=timeout)
    try:
        status = client.status()
    except AgentError as exc:
        return None, f"the agent of {who} does not answer: {exc}"
    finally:
        client.close()
    other = (pid is not None and status.pid != pid) or (
        incarnation is not None and status.incarnation != incarnation
    )
    if status.node_id != node_id or other:
        return None, f"{url} is not the agent of {who} any more"
    if status.attempt != attempt or status.state not in _LIVE:
        return None, (
            f"the agent of {node_id} is {status.state} (attempt {status.attempt}), "
            f"not running attempt {attempt}"
        )
    return status, None


class AdoptedNode(WorkerPids):
    """A node agent that a dead controller launched: known by its pid (and that pid's
    start time, so a reused pid is never taken for it) and its URL."""

    def __init__(self, agent: LiveAgent) -> None:
        self.node_id = agent.node_id
        self.incarnation = agent.incarnation
        self.url = agent.url
        self.address = urlsplit(agent.url).hostname or "127.0.0.1"
        self.hostname = socket.gethostname()  # adopted agents are this machine's
        self._pid = agent.pid
        self._started = agent.started
        super().__init__()

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def console(self) -> IO[bytes] | None:
        return None  # its output went to the dead controller; `trainguard logs` has it

    def port(self) -> int | None:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])

    def alive(self) -> bool:
        return runs(self._pid, self._started)

    def exited(self) -> str | None:
        return None if self.alive() else "its agent process is gone"

    def shutdown(self, client: AgentClient | None) -> None:
        if self.alive() and client is not None:
            with contextlib.suppress(AgentError):
                client.shutdown()
            deadline = time.monotonic() + AGENT_SHUTDOWN_SECONDS
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        # Neither the agent nor its workers are children of this process: each is
        # signalled only while its pid still names the process seen with its start time.
        kill_recorded(self._pid, self._started)  # the agent leads its own session
        self.kill_workers()


Begin = Callable[[float], list[Action]]


def reattached(
    controller: JobController,
    record: Recorded,
    nodes: Sequence[str],
    transport: AgentTransport,
    retire: Callable[[list[str]], None],
) -> tuple[Begin | None, str]:
    """The takeover both platforms share (a resumed local job, a job a new operator
    replica takes over): the adopted ``nodes``' agents are told to report to this
    controller (the transport's ``report_url``; None: they are polled only); when every
    one took it, how the job begins (adopted as it runs); else they are retired, and why."""
    failed = []
    if (url := transport.report_url) is not None:
        request = AttachRequest(report_url=url, pid=os.getpid(), start=start_ticks(os.getpid()))
        for client in [c for n in nodes if (c := transport.client(n)) is not None]:
            try:
                client.attach(request)
            except AgentError as exc:
                failed.append(str(exc))
    if failed:
        retire(list(nodes))
        return None, f"an agent refused to be attached ({failed[0]})"

    def reattach(now: float) -> list[Action]:
        controller.take_over(now, control.adopt(controller.config, now, record, nodes))
        return []

    return reattach, ""


def resumed_begin(
    store: Store,
    job: JobRow,
    token: str,
    platform: LocalPlatform,
    controller: JobController,
    say: Callable[[str], None],
    restart_blocked: str | None = None,
) -> Begin:
    """How a resumed job begins: re-attach to its live agents, or restart it from the
    newest checkpoint (``say`` tells which, and why)."""
    rec = recorded(store, job)
    newest = rec.newest
    agents, why = live_agents(store, job, token, newest.number if newest else None)
    if agents:
        platform.adopt([AdoptedNode(a) for a in agents], [a.url for a in agents])
        nodes = [a.node_id for a in agents]
        begin, why = reattached(controller, rec, nodes, platform.transport, platform.retire)
        if begin is not None:
            say(
                f"re-attached to the {len(agents)} node agents of the running attempt: "
                f"training went on; its output is in `trainguard logs {job.id}`"
            )
            return begin
    else:
        _shut_down_leftovers(store, job, token)
    reason = why or "its agents are gone"
    if restart_blocked is not None:
        message = f"cannot re-attach ({reason}), nor restart: {restart_blocked}"
        say(message)
        return lambda now: controller.cancel(now, message, JobPhase.FAILED)
    say(f"cannot re-attach: {reason}; restarting from the newest checkpoint")
    return lambda now: controller.take_over(
        now, control.restart(controller.config, now, rec, reason)
    )


def _shut_down_leftovers(store: Store, job: JobRow, token: str) -> None:
    """Ask whatever agent of the job still answers to stop its workers and exit (an
    authenticated request: never a signal to a pid that may have been reused)."""
    for row in store.nodes(job.id):
        if not row["agent_url"]:
            continue
        client = AgentClient(row["agent_url"], token, timeout=5.0)
        with contextlib.suppress(AgentError):
            client.shutdown()
        client.close()
