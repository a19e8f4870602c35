"""A fleet of simulated node agents in one process, each speaking the real agent HTTP API.

    python -m bench.fleet --job-dir DIR --token-file FILE --nodes-file NODES \
        --nproc 8 --record fleet.json [--victim node-1]

Every node gets the real :class:`trainguard.agent.server.AgentHTTPServer` on its own
loopback port (announced in ``<job dir>/agents/<node>.port``, as a real agent does),
backed by a :class:`FakeSupervisor` instead of real workers: ``/start`` makes the node
``running`` with ``nproc`` workers that report a step every 0.1 s, ``/stop`` makes it
``stopped``. One selector thread serves every node's socket. SIGUSR1 fails one worker
of ``--victim`` (a ``WorkerCrash`` for the controller). The first ``/shutdown`` of any
node writes ``--record`` (when each node got ``/start`` and ``/stop``, the victim's
fault time, the status polls of the first node) and ends the fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, cast

from trainguard.agent.__main__ import write_port_file
from trainguard.agent.server import AgentHTTPServer
from trainguard.agent.status import AgentState, AgentStatus, WorkerState, WorkerStatus
from trainguard.agent.supervisor import StartRefused, Supervisor
from trainguard.control.assignment import NodeAssignment

STEP_SECONDS = 0.1
"""How fast the simulated workers' step counter advances."""


class FakeSupervisor:
    """What the agent's HTTP handlers call on a :class:`Supervisor`, with no workers."""

    def __init__(self, node_id: str, nproc: int) -> None:
        self.node_id = node_id
        self.nproc = nproc
        self._lock = threading.Lock()
        self._state = AgentState.READY
        self._assignment: NodeAssignment | None = None
        self._started_at = 0.0
        self._reason: str | None = None
        self._failed_rank: int | None = None
        self.start_at: float | None = None  # first /start received
        self.stop_at: float | None = None  # first /stop received after a start
        self.failed_at: float | None = None
        self.status_times: list[float] = []
        self.on_shutdown: threading.Event | None = None

    def snapshot(self) -> AgentStatus:
        now = time.time()
        with self._lock:
            self.status_times.append(now)
            assignment, state = self._assignment, self._state
            workers: tuple[WorkerStatus, ...] = ()
            progress: dict[str, Any] = {}
            if assignment is not None:
                step = int((now - self._started_at) / STEP_SECONDS)
                workers = tuple(self._worker(assignment, i) for i in range(self.nproc))
                progress = {
                    str(rank): {
                        "first_step": 1,
                        "first_time": self._started_at,
                        "step": max(1, step),
                        "time": now,
                    }
                    for rank in assignment.global_ranks
                }
            return AgentStatus(
                node_id=self.node_id,
                pid=os.getpid(),
                state=state,
                attempt=assignment.attempt if assignment else None,
                reason=self._reason,
                updated_at=now,
                workers=workers,
                monitor={"rules": {}, "progress": progress, "detections": []},
            )

    def request_start(self, assignment: NodeAssignment) -> None:
        with self._lock:
            if self._state.is_active:
                raise StartRefused(f"attempt {self._assignment and self._assignment.attempt} runs")
            now = time.time()
            self.start_at = self.start_at or now
            self._assignment = replace(assignment, peers={})  # O(nodes) each; unused here
            self._started_at = now
            self._state = AgentState.RUNNING
            self._reason = None
            self._failed_rank = None

    def request_stop(
        self, attempt: int | None, mode: str, timeout: float, capture_stacks: bool = False
    ) -> None:
        with self._lock:
            if self.start_at is not None:
                self.stop_at = self.stop_at or time.time()
            if self._state.is_active or self._state is AgentState.FAULTED:
                self._state = AgentState.STOPPED
                self._reason = f"stop requested ({mode})"

    def request_persist(self, step: int, world_size: int, commit: bool) -> None:
        """Nothing to persist: these nodes keep no checkpoints."""

    def request_shutdown(self, reason: str) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown.set()

    def fail_worker(self) -> None:
        """The node's first worker dies of SIGKILL (the agent then reports ``faulted``)."""
        with self._lock:
            if self._assignment is None or self._state is not AgentState.RUNNING:
                return
            self._failed_rank = self._assignment.global_ranks[0]
            self._state = AgentState.FAULTED
            self._reason = f"rank {self._failed_rank} exited with signal SIGKILL"
            self.failed_at = time.time()

    def _worker(self, assignment: NodeAssignment, local_rank: int) -> WorkerStatus:
        rank = assignment.global_ranks[local_rank]
        if rank == self._failed_rank:
            return WorkerStatus(local_rank, rank, None, WorkerState.FAILED, -9, "SIGKILL")
        if self._state is AgentState.RUNNING or self._state is AgentState.FAULTED:
            return WorkerStatus(local_rank, rank, None, WorkerState.RUNNING)
        return WorkerStatus(local_rank, rank, None, WorkerState.STOPPED)

    def record(self) -> dict[str, Any]:
        return {"start_at": self.start_at, "stop_at": self.stop_at, "failed_at": self.failed_at}


def serve(servers: list[AgentHTTPServer], done: threading.Event) -> None:
    """Serve every node's socket from this one thread until ``done``."""
    with selectors.DefaultSelector() as selector:
        for server in servers:
            selector.register(server, selectors.EVENT_READ, server)
        while not done.is_set():
            for key, _ in selector.select(timeout=0.2):
                cast(AgentHTTPServer, key.data).handle_request()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job-dir", type=Path, required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--nodes-file", type=Path, required=True, help="node ids, one a line")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--victim", default=None, help="node whose worker SIGUSR1 fails")
    args = parser.parse_args(argv)
    token = args.token_file.read_text().strip()
    done = threading.Event()
    nodes = args.nodes_file.read_text().split()
    fakes = [FakeSupervisor(node, args.nproc) for node in nodes]
    servers = []
    for fake in fakes:
        fake.on_shutdown = done
        server = AgentHTTPServer("127.0.0.1", 0, cast(Supervisor, fake), token)
        server.timeout = 0  # handle_request() is only called when a request is waiting
        servers.append(server)
    victim = next((f for f in fakes if f.node_id == args.victim), None)

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        if victim is not None:
            victim.fail_worker()

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, lambda signum, frame: done.set())
    thread = threading.Thread(target=serve, args=(servers, done), daemon=True)
    thread.start()
    agents = args.job_dir / "agents"
    agents.mkdir(parents=True, exist_ok=True)
    for fake, server in zip(fakes, servers, strict=True):
        write_port_file(agents / f"{fake.node_id}.port", server.port)
    while not done.wait(0.5):
        pass
    record = {
        "nodes": {f.node_id: f.record() for f in fakes},
        "status_times": fakes[0].status_times,
    }
    tmp = args.record.with_name(f".{args.record.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, args.record)
    time.sleep(0.2)  # let the shutdown reply go out
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
