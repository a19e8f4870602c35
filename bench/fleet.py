"""A fleet of simulated node agents in one process, each serving the real agent API.

    python -m bench.fleet --token-file FILE --nodes-file NODES --ports-file PORTS \
        --nproc 8 --record fleet.json [--victim node-1] [--push changes|faults]

``NODES`` holds ``node_id incarnation`` lines. Every node is a :class:`FakeNode` (the
:class:`~trainguard.agent.api.NodeControl` the real agent's supervisor is) behind the
real :class:`~trainguard.agent.api.AgentApi`, served by aiohttp on its own loopback port:
one event loop for the whole fleet, one listening socket per node, HTTP/1.1 keep-alive
(the controller keeps one connection per agent open). Once every node listens, the
fleet writes ``node_id port`` lines to ``PORTS`` (atomically, all at once).

- ``/start`` makes a node ``running`` with ``nproc`` workers whose progress advances a
  step every 0.1 s; ``/stop`` makes it ``stopped``. A node reports the incarnation it
  was launched with and bumps ``seq`` on every change, as a real agent does.
- SIGUSR1 fails the first worker of ``--victim`` (SIGKILL, a ``WorkerCrash`` for the
  controller). Report first: the node pushes its status to the ``report_url`` of its
  latest ``/start`` with the job's token, as a real agent's reporter does: news only
  (``--push faults``, the default, like a real agent); ``--push changes`` also pushes
  every change of state (started, stopped), which the real agent stopped doing because
  thousands of such pushes slowed the controller's start and stop broadcasts.
  The fleet's pushes share a pool of kept-alive connections (a real agent keeps one);
  a push waits for one of them, then has the agent's time limit.
- The fleet ends once every node got ``/shutdown`` (or on SIGTERM) and writes
  ``--record``: per node when ``/start``, ``/stop`` and ``/shutdown`` arrived, the
  victim's failure time and when the controller accepted its push, the status poll
  times of the fleet's first node, the pushes made and the fleet's peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from trainguard.agent.api import AgentApi, Refused, Reply
from trainguard.agent.server import MAX_BODY_BYTES
from trainguard.wire.requests import (
    AttemptRequest,
    NodeAssignment,
    PersistRequest,
    ReplaceRequest,
    StopRequest,
)
from trainguard.wire.status import (
    MonitorSnapshot,
    NodeState,
    NodeStatus,
    Progress,
    WorkerState,
    WorkerStatus,
)

STEP_SECONDS = 0.1
"""How fast the simulated workers' step counter advances."""
PUSH_CONNECTIONS = 64
"""Kept-alive connections the fleet's pushes share."""
PUSH_TIMEOUT_SECONDS = 2.0  # as the real agent's reporter
BACKLOG = 512
PUSH_MODES = ("changes", "faults")

_ACTIVE = (NodeState.STARTING, NodeState.RUNNING, NodeState.STOPPING)


class FakeNode:
    """One simulated node: what the agent API drives, with no worker processes.

    Lives on the fleet's event loop (every call comes from it), so it needs no lock.
    """

    def __init__(self, fleet: Fleet, node_id: str, incarnation: str, nproc: int) -> None:
        self.fleet = fleet
        self.node_id = node_id
        self.incarnation = incarnation
        self.nproc = nproc
        self.state = NodeState.READY
        self.seq = 0
        self.updated_at = time.time()
        self.reason: str | None = None
        self.assignment: NodeAssignment | None = None
        self.started_at = 0.0
        self.failed_rank: int | None = None
        self.report_url: str | None = None
        self._cached: tuple[tuple[int, int], NodeStatus] | None = None
        self._pushing = False
        self._push_again = False
        # What the benchmark reads.
        self.start_at: float | None = None  # first /start
        self.stop_at: float | None = None  # first /stop after a start
        self.shutdown_at: float | None = None
        self.failed_at: float | None = None
        self.pushed_at: float | None = None  # the controller accepted the fault's push
        self.status_times: list[float] | None = None  # kept for one node per fleet

    # -- NodeControl ---------------------------------------------------------------------

    def snapshot(self) -> NodeStatus:
        """``GET /status``."""
        if self.status_times is not None:
            self.status_times.append(time.time())
        return self.status()

    def status(self) -> NodeStatus:
        """The node's status now (cached while nothing changed)."""
        now = time.time()
        step = int((now - self.started_at) / STEP_SECONDS) if self.assignment else 0
        key = (self.seq, step)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._build(step))
        return self._cached[1]

    def request_start(self, request: AttemptRequest) -> None:
        assignment = request.assignment
        if self.state in _ACTIVE:
            if self.assignment is not None and self.assignment.attempt == assignment.attempt:
                return  # a retried request
            raise Refused(f"attempt {self.assignment and self.assignment.attempt} is running")
        now = time.time()
        self.start_at = self.start_at or now
        # The peers' URLs (O(nodes) per node with replicas) are not needed here.
        self.assignment = assignment
        self.started_at = now
        self.report_url = request.report_url
        self.failed_rank = None
        self._change(NodeState.RUNNING, None, push=True)

    def request_rejoin(self, request: AttemptRequest) -> None:
        raise Refused("a simulated node has no resilient workers to rejoin")

    def request_replace(self, request: ReplaceRequest) -> None:
        raise Refused("a simulated node has no resilient workers to replace")

    def request_stop(self, request: StopRequest) -> None:
        if self.start_at is not None:
            self.stop_at = self.stop_at or time.time()
        attempt = self.assignment.attempt if self.assignment else None
        if request.attempt is not None and attempt is not None and request.attempt != attempt:
            return  # a late stop of another attempt
        if self.state in _ACTIVE or self.state is NodeState.FAULTED:
            self._change(NodeState.STOPPED, f"stop requested ({request.mode})", push=True)

    def request_persist(self, request: PersistRequest) -> None:
        raise Refused("a simulated node keeps no checkpoints")

    def request_shutdown(self, reason: str) -> None:
        self.shutdown_at = self.shutdown_at or time.time()
        self.fleet.shut_down(self)

    # -- faults ----------------------------------------------------------------------------

    def fail_worker(self) -> None:
        """The node's first worker dies of SIGKILL: the node turns ``faulted`` and pushes
        that at once (report first)."""
        if self.assignment is None or self.state is not NodeState.RUNNING:
            return
        self.failed_at = time.time()
        self.failed_rank = self.assignment.global_ranks[0]
        reason = f"rank {self.failed_rank} exited with signal SIGKILL"
        self._change(NodeState.FAULTED, reason, push=True, fault=True)

    # -- internals ---------------------------------------------------------------------------

    def _change(
        self, state: NodeState, reason: str | None, *, push: bool, fault: bool = False
    ) -> None:
        self.state = state
        self.reason = reason
        self.seq += 1
        self.updated_at = time.time()
        if push and (fault or self.fleet.push_mode == "changes"):
            self._nudge()

    def _nudge(self) -> None:
        """Push the newest status soon; a burst of changes sends the newest once."""
        if self.report_url is None:
            return
        if self._pushing:
            self._push_again = True
            return
        self._pushing = True
        self.fleet.spawn(self._push_loop())

    async def _push_loop(self) -> None:
        try:
            while True:
                self._push_again = False
                url = self.report_url
                if url is None:
                    return
                status = self.status()
                accepted = await self.fleet.push(url, status.model_dump_json().encode())
                if accepted and status.state is NodeState.FAULTED and self.pushed_at is None:
                    self.pushed_at = time.time()
                if not self._push_again:
                    return
        finally:
            self._pushing = False

    def _build(self, step: int) -> NodeStatus:
        assignment = self.assignment
        workers: tuple[WorkerStatus, ...] = ()
        progress: Progress | None = None
        if assignment is not None:
            workers = tuple(
                self._worker(local, rank) for local, rank in enumerate(assignment.global_ranks)
            )
            if self.state in (NodeState.RUNNING, NodeState.FAULTED):
                shown = max(1, step)
                progress = Progress(  # the node's ranks together, as an agent reports them
                    first_step=1,
                    first_time=self.started_at,
                    step=shown,
                    time=self.started_at + shown * STEP_SECONDS,
                )
        return NodeStatus(
            node_id=self.node_id,
            incarnation=self.incarnation,
            pid=os.getpid(),
            seq=self.seq,
            state=self.state,
            attempt=assignment.attempt if assignment else None,
            reason=self.reason,
            updated_at=self.updated_at,
            workers=workers,
            monitor=MonitorSnapshot(progress=progress),
        )

    def _worker(self, local: int, rank: int) -> WorkerStatus:
        if rank == self.failed_rank:
            return WorkerStatus(
                local_rank=local,
                rank=rank,
                state=WorkerState.FAILED,
                exitcode=-signal.SIGKILL,
                signal="SIGKILL",
            )
        running = self.state in (NodeState.RUNNING, NodeState.FAULTED)
        state = WorkerState.RUNNING if running else WorkerState.STOPPED
        return WorkerStatus(local_rank=local, rank=rank, state=state)

    def record(self) -> dict[str, Any]:
        return {
            "start_at": self.start_at,
            "stop_at": self.stop_at,
            "shutdown_at": self.shutdown_at,
            "failed_at": self.failed_at,
            "pushed_at": self.pushed_at,
        }


class Fleet:
    """Every node of this process, their sockets, and the pushes (one event loop)."""

    def __init__(self, token: str, nodes: list[tuple[str, str]], nproc: int, push_mode: str):
        self.token = token
        self.push_mode = push_mode
        self.nodes = [FakeNode(self, node_id, inc, nproc) for node_id, inc in nodes]
        self.nodes[0].status_times = []
        self.apis: dict[int, AgentApi] = {}  # by local port
        self.done = asyncio.Event()
        self.pushes = 0
        self.push_failures = 0
        self.push_errors: list[str] = []  # the first few
        self._shut: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._servers: list[asyncio.Server] = []

    async def serve(self) -> dict[str, int]:
        """Listen on a port per node; returns each node's port."""
        loop = asyncio.get_running_loop()
        server = web.Server(self._handle, access_log=None)
        ports = {}
        for node in self.nodes:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            self._servers.append(await loop.create_server(server, sock=sock, backlog=BACKLOG))
            self.apis[port] = AgentApi(node, self.token)
            ports[node.node_id] = port
        connector = aiohttp.TCPConnector(limit=PUSH_CONNECTIONS)
        # A real agent has a connection of its own: waiting for one of the fleet's shared
        # connections is no part of a push's time limit, connecting and the reply are.
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=PUSH_TIMEOUT_SECONDS, sock_read=PUSH_TIMEOUT_SECONDS
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return ports

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=PUSH_TIMEOUT_SECONDS)
        if self._session is not None:
            await self._session.close()

    def spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def shut_down(self, node: FakeNode) -> None:
        self._shut.add(node.node_id)
        if len(self._shut) == len(self.nodes):
            # After the reply went out (the API runs ``after`` once it is sent).
            asyncio.get_running_loop().call_later(0.05, self.done.set)

    async def push(self, url: str, body: bytes) -> bool:
        """POST a status to the controller; True when it took it."""
        assert self._session is not None
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        self.pushes += 1
        try:
            async with self._session.post(url, data=body, headers=headers) as response:
                await response.read()
                if response.status >= 300:
                    self._push_error(f"{response.status}")
                    return False
                return True
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._push_error(f"{type(exc).__name__}: {exc}")
            return False

    def _push_error(self, error: str) -> None:
        self.push_failures += 1
        if len(self.push_errors) < 5:
            self.push_errors.append(error)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The agent server's handling of one request (see ``agent/server.py``)."""
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        api = self.apis.get(sockname[1]) if sockname else None
        if api is None:
            return _send(Reply(500, b'{"error": "no node on this port"}'))
        if not api.authorized(request.headers.get("Authorization")):
            return _send(Reply(401, b'{"error": "missing or wrong bearer token"}'), close=True)
        unknown = api.route(request.method, request.path)
        if unknown is not None:
            return _send(unknown, close=True)
        if (request.content_length or 0) > MAX_BODY_BYTES:
            body = f'{{"error": "body larger than {MAX_BODY_BYTES} bytes"}}'.encode()
            return _send(Reply(413, body), close=True)
        body = await request.read()
        reply = api.handle(request.method, request.path, body)
        response = _send(reply)
        if reply.after is not None:
            await response.prepare(request)
            await response.write_eof()
            reply.after()
        return response

    def record(self) -> dict[str, Any]:
        return {
            "nodes": {n.node_id: n.record() for n in self.nodes},
            "status_times": self.nodes[0].status_times,
            "pushes": self.pushes,
            "push_failures": self.push_failures,
            "push_errors": self.push_errors,
            "rss_peak_mib": _proc_status_kib("VmHWM") / 1024,
        }


def _send(reply: Reply, close: bool = False) -> web.Response:
    response = web.Response(
        status=reply.status,
        body=reply.body,
        headers={"Content-Type": "application/json", **reply.headers},
    )
    if close:
        response.force_close()
    return response


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return 0


def read_nodes(path: Path) -> list[tuple[str, str]]:
    """``node_id incarnation`` lines (an incarnation may be left out: ``""``)."""
    nodes = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts:
            nodes.append((parts[0], parts[1] if len(parts) > 1 else ""))
    return nodes


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def raise_open_files_limit(wanted: int) -> None:
    """Up to ``wanted`` open files (sockets): a node's port and connections each take one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return
    with contextlib.suppress(ValueError, OSError):  # not privileged: keep the limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
        return
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    token = args.token_file.read_text().strip()
    fleet = Fleet(token, read_nodes(args.nodes_file), args.nproc, args.push)
    loop = asyncio.get_running_loop()
    victim = next((n for n in fleet.nodes if n.node_id == args.victim), None)
    if victim is not None:
        loop.add_signal_handler(signal.SIGUSR1, victim.fail_worker)
    loop.add_signal_handler(signal.SIGTERM, fleet.done.set)
    ports = await fleet.serve()
    write_atomically(args.ports_file, "".join(f"{n} {p}\n" for n, p in ports.items()))
    await fleet.done.wait()
    await fleet.close()
    return fleet.record()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument(
        "--nodes-file", type=Path, required=True, help="'node_id incarnation' lines"
    )
    parser.add_argument("--ports-file", type=Path, required=True, help="written once serving")
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--victim", default=None, help="node whose worker SIGUSR1 fails")
    parser.add_argument("--push", choices=PUSH_MODES, default="faults")
    args = parser.parse_args(argv)
    nodes = len(read_nodes(args.nodes_file))
    raise_open_files_limit(3 * nodes + 1024)  # a port and up to two connections per node
    record = asyncio.run(run(args))
    write_atomically(args.record, json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
