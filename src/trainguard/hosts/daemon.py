"""A joining host's side of a multi-host job: ``trainguard run ... --rdzv-endpoint`` on a
host that does not own the endpoint.

:class:`HostDaemon` joins the controller (retrying until ``--join-timeout``), serves
``POST /launch`` and ``POST /shutdown`` for it (node agents on this host, bound to the
address that reaches the controller), copies its agents' console (its ranks' lines) to
this terminal, and renews its lease every ``lease_seconds``.

A host that joins as a spare is kept warm: its daemon starts the spare node's agent at
once, as a standby (``--standby``: its worker template imports torch and the script's
modules, and it runs no check and no attempt). When the controller launches that node
here, the daemon only gives the standby agent the launch's incarnation (``POST
/assign``) and answers with its port: the replacement of a lost node does not wait for an
interpreter, the agent's imports and ``import torch``. A launch of another node id (the
controller moved a lost node here under its own id) stops the standby and starts a
fresh agent, as does a standby that died or refused. It ends with the job: when
a lease says the job finished, the process exits with the job's exit code.

Fencing (a host cut off from the network keeps running, and could keep training and
writing): when no lease renewal succeeds for ``partition_timeout`` seconds, the daemon
shuts its agents down (their workers die with them); when a lease says the host was
declared lost, the same at once. Either way it then joins again as a new host, so a host
that comes back takes part only as a new spare node. A node's agent also refuses to
commit to the durable tier once the controller has not reached it for its fence time
(:mod:`trainguard.agent.persist`), shorter than the controller's lost-node bound, so
nothing a node writes after it was declared lost reaches durable storage.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from aiohttp import web

from trainguard.agent.client import AgentClient, AgentError
from trainguard.health.suite import Peers
from trainguard.hosts.addresses import Endpoint, LocalAddress
from trainguard.observe.terminal import safe_bytes
from trainguard.platform.inbox import RouteServer, bearer_ok
from trainguard.platform.node import AgentLauncher, LocalNode
from trainguard.wire.base import WireError, parse_json
from trainguard.wire.hosts import (
    HostLease,
    JoinReply,
    JoinRequest,
    LaunchReply,
    LaunchRequest,
    PartitionRequest,
    ShutdownRequest,
)
from trainguard.wire.requests import AssignRequest

__all__ = ["EXIT_JOIN_REFUSED", "EXIT_LOST_CONTROLLER", "HostDaemon", "JoinError"]

logger = logging.getLogger(__name__)

EXIT_JOIN_REFUSED = 2  # the controller turned this host down: a usage error
EXIT_LOST_CONTROLLER = 1
PARTITION_ENV = "TRAINGUARD_ALLOW_PARTITION"  # "1": --inject partition may cut this host off
JOIN_RETRY_SECONDS = 0.5
JOIN_QUIET_SECONDS = 10.0  # a join unanswered this long is said, and again every:
JOIN_REMIND_SECONDS = 30.0
PORT_WAIT_SECONDS = 60.0
REQUEST_TIMEOUT = 5.0
ASSIGN_TIMEOUT = 5.0  # a standby agent takes its node (POST /assign): it only queues it


class JoinError(RuntimeError):
    """The controller refused this host (the message says why), or never answered."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class HostDaemon:
    """One joining host's part in a job (see the module doc)."""

    def __init__(
        self,
        endpoint: Endpoint,
        token: str,
        local: LocalAddress,
        spec: dict[str, Any],
        make_launcher: Callable[[JoinReply], AgentLauncher],
        *,
        node_rank: int | None = None,
        join_timeout: float = 600.0,
        tls_server: ssl.SSLContext | None = None,
        tls_client: ssl.SSLContext | None = None,
        say: Callable[[str], None] = lambda line: None,
        out: IO[bytes] | None = None,
        first_launch: Callable[[JoinReply, str], None] = lambda reply, node_id: None,
        on_progress: Callable[[JoinReply, str, int], None] = lambda reply, phase, n: None,
    ) -> None:
        """``make_launcher``: this host's agent launcher for the job the controller named
        (its id, in the reply); ``out``: where this host's ranks' lines go;
        ``first_launch``: called before a node id's first agent since this host joined
        (not before its relaunches, which resume from what the node left here);
        ``on_progress``: the job's phase and restarts, as the controller has them, each
        time they change (this host's record of the job follows them)."""
        self.endpoint = endpoint
        self._token = token
        self.local = local
        self.spec = spec
        self._make_launcher = make_launcher
        self._first_launch = first_launch
        self._on_progress = on_progress
        self.progress: tuple[str, int] | None = None  # the newest lease's phase, restarts
        self.node_rank = node_rank
        self.join_timeout = join_timeout
        self._tls_client = tls_client
        self._say = say
        self._out = out
        scheme = "https" if tls_client is not None else "http"
        self.controller_url = f"{scheme}://{_bracket(endpoint.host)}:{endpoint.port}"
        self._lock = threading.Lock()
        self._nodes: dict[str, LocalNode] = {}
        self.launched: set[str] = set()  # every node id this host ran: its memory tier's name
        self._joined_launches: set[str] = set()  # those since the last join
        self._standby: set[str] = set()  # node ids whose agent waits, warm, for its launch
        # One more each time this host's agents are all stopped (fenced, the job's end):
        # a standby that comes up after that stops at once.
        self._generation = 0
        self._starting = threading.Lock()  # one agent start (or standby's) at a time
        self._launcher: AgentLauncher | None = None
        self._ready = threading.Event()  # set once the join's answer is taken in
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="tg-daemon")
        self.server = RouteServer(
            local.addr,
            0,
            [
                web.post("/launch", self._launch),
                web.post("/shutdown", self._shutdown),
                *([web.post("/partition", self._partition)] if partition_allowed() else []),
            ],
            tls=tls_server,
            name="tg-host-daemon",
        )
        self.host_id = ""
        self.reply: JoinReply | None = None

    # -- the run -------------------------------------------------------------------------

    def run(self) -> int:
        """Join, then keep the lease until the job ends; the exit code to end with."""
        try:
            while True:
                self._ready.clear()
                try:
                    self.reply = reply = self.join()
                    self._joined_launches = set()
                except JoinError as exc:
                    self._say(str(exc))
                    return EXIT_JOIN_REFUSED if exc.refused else EXIT_LOST_CONTROLLER
                self._launcher = self._make_launcher(reply)
                self._ready.set()
                self._say(
                    f"joined job {reply.job_id} at {self.controller_url} as {reply.node_id} "
                    f"({reply.role}); this host is {self.local.addr}"
                    + (f" on {self.local.ifname}" if self.local.ifname else "")
                )
                if reply.role == "spare":
                    self._pool.submit(self._warm_spare, reply, self._generation)
                outcome = self._keep_lease(reply)
                if isinstance(outcome, int):
                    return outcome
                self._say(outcome)  # fenced: join again, as a new host
        finally:
            self._shutdown_all()
            self.server.close()
            self._pool.shutdown(wait=False)

    def join(self) -> JoinReply:
        """Ask to take part until the controller answers (or ``join_timeout`` passes)."""
        self.host_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        request = JoinRequest(
            hostname=socket.gethostname(),
            addr=self.local.addr,
            ifname=self.local.ifname,
            node_rank=self.node_rank,
            host_id=self.host_id,
            daemon_url=self.server.url,
            spec=self.spec,
        )
        started = time.monotonic()
        deadline, tell_at = started + self.join_timeout, started + JOIN_QUIET_SECONDS
        last = "no answer yet"
        while (now := time.monotonic()) < deadline:
            if now >= tell_at:  # an endpoint that never answers is said, not waited out
                tell_at = now + JOIN_REMIND_SECONDS
                self._say(
                    f"cannot reach the controller at {self.controller_url} yet ({last}); "
                    f"still trying for {deadline - now:.0f}s (--join-timeout): check "
                    "--rdzv-endpoint's host and port, and that trainguard run is started there"
                )
            try:
                answer = self._post("/join", request.to_json())
                return JoinReply.from_json(answer, "join reply")
            except urllib.error.HTTPError as exc:
                detail = _error_of(exc)
                if exc.code in (401, 409, 400):
                    raise JoinError(f"the controller refused this host: {detail}", True) from None
                last = f"HTTP {exc.code}: {detail}"
            except (OSError, ValueError, WireError) as exc:
                last = str(exc)
            time.sleep(JOIN_RETRY_SECONDS)
        raise JoinError(
            f"could not join {self.controller_url} within {self.join_timeout:g}s ({last})",
            False,
        )

    def _keep_lease(self, reply: JoinReply) -> int | str:
        """Renew the lease; the job's exit code when it ends, or why this host was fenced."""
        last_ok = time.monotonic()
        while True:
            time.sleep(reply.lease_seconds)
            try:
                answer = self._get(f"/hosts/{self.host_id}", timeout=2 * reply.lease_seconds)
                lease = HostLease.from_json(answer, "lease")
            except (OSError, ValueError, WireError, urllib.error.HTTPError) as exc:
                cut_for = time.monotonic() - last_ok
                if cut_for >= reply.partition_timeout:
                    self._shutdown_all()
                    return (
                        f"no word from the controller for {cut_for:.0f}s "
                        f"(partitionTimeoutSeconds {reply.partition_timeout:g}; last: {exc}): "
                        "this host's workers are stopped; joining again as a new host"
                    )
                continue
            last_ok = time.monotonic()
            for line in lease.events:  # the job's events, as the controller printed them
                self._say(line)
            if (progress := (lease.phase, lease.restarts)) != self.progress:
                self.progress = progress
                self._on_progress(reply, *progress)
            if lease.finished:
                self._shutdown_all()
                self._say(f"job {reply.job_id} ended: {lease.reason} (exit {lease.exit_code})")
                return lease.exit_code if lease.exit_code is not None else EXIT_LOST_CONTROLLER
            if lease.standing == "lost":
                self._shutdown_all()
                return (
                    f"the controller declared {reply.node_id} lost: this host's workers are "
                    "stopped; joining again as a new host"
                )

    # -- the routes ----------------------------------------------------------------------

    async def _launch(self, request: web.Request) -> web.Response:
        if not bearer_ok(request, self._token.encode()):
            return _error(401, "missing or wrong bearer token")
        try:
            launch = parse_json(LaunchRequest, await request.read(), "launch")
        except WireError as exc:
            return _error(400, str(exc))
        try:
            reply = await _in_thread(self._pool, lambda: self._start_agent(launch))
        except (OSError, RuntimeError) as exc:
            return _error(409, f"cannot launch {launch.node_id}: {exc}")
        return web.json_response(reply.to_json())

    async def _shutdown(self, request: web.Request) -> web.Response:
        if not bearer_ok(request, self._token.encode()):
            return _error(401, "missing or wrong bearer token")
        try:
            stop = parse_json(ShutdownRequest, await request.read(), "shutdown")
        except WireError as exc:
            return _error(400, str(exc))
        await _in_thread(self._pool, lambda: self._shutdown_node(stop.node_id))
        return web.json_response({"accepted": True}, status=202)

    async def _partition(self, request: web.Request) -> web.Response:
        """A rehearsal (``--inject partition``): this host cuts itself off the network."""
        if not bearer_ok(request, self._token.encode()):
            return _error(401, "missing or wrong bearer token")
        try:
            cut = parse_json(PartitionRequest, await request.read(), "partition")
        except WireError as exc:
            return _error(400, str(exc))
        why = partition_unavailable(self.local.ifname)
        if why is not None:
            return _error(409, why)
        assert self.local.ifname is not None
        threading.Thread(
            target=cut_off, args=(self.local.ifname, cut.seconds), daemon=True, name="tg-cut"
        ).start()
        return web.json_response({"accepted": True}, status=202)

    # -- the agents ----------------------------------------------------------------------

    def _start_agent(self, launch: LaunchRequest) -> LaunchReply:
        # The controller may launch the moment it has taken the join in, before this
        # host has read the answer: wait for it.
        if not self._ready.wait(PORT_WAIT_SECONDS):
            raise RuntimeError("this host has not joined yet")
        with self._starting:
            with self._lock:
                others = self._standby - {launch.node_id}
            for node_id in others:  # a standby of another node id is of no use now
                self._shutdown_node(node_id)
            if launch.node_id in self._standby and (taken := self._assign(launch)) is not None:
                return taken
            return self._fresh_agent(launch)

    def _fresh_agent(self, launch: LaunchRequest) -> LaunchReply:
        launcher, reply = self._launcher, self.reply
        assert launcher is not None and reply is not None
        self._shutdown_node(launch.node_id)  # a relaunch replaces the node's agent
        if launch.node_id not in self._joined_launches:  # after a fence too: a new host
            self._first_launch(reply, launch.node_id)
        peers = Peers(*launch.peers) if launch.peers is not None else None
        node = launcher(launch.node_id, launch.incarnation, peers)
        self._took(launch.node_id, node)
        port = self._serving(node)
        pid = node.pid
        assert pid is not None
        return LaunchReply(pid=pid, port=port)

    def _warm_spare(self, reply: JoinReply, generation: int) -> None:
        """Start the spare node's agent as a standby (see the module doc), unless this
        host's agents were all stopped since ``generation`` (fenced, or the job ended)."""
        node_id = reply.node_id
        with self._starting:
            launcher = self._launcher
            if launcher is None or self._generation != generation:
                return  # fenced (and maybe joined again) since: a new join warms its own
            self._first_launch(reply, node_id)
            try:
                node = launcher(node_id, f"{node_id}.standby", None, standby=True)
            except OSError as exc:
                logger.warning("the spare's standby agent could not start: %s", exc)
                return  # its launch starts a fresh agent
            self._took(node_id, node, standby=True)
            try:
                self._serving(node)
            except RuntimeError as exc:
                self._say(f"{node_id}: the standby agent of this spare host failed ({exc})")
                self._shutdown_node(node_id)
                return
        with self._lock:
            stale = self._generation != generation
        if stale:  # fenced while it started: it must not outlive that
            self._shutdown_node(node_id)
            return
        self._say(f"{node_id}: this spare host's agent is up, idle until the job needs it")

    def _assign(self, launch: LaunchRequest) -> LaunchReply | None:
        """Give ``launch.node_id``'s standby agent its incarnation; None when it cannot
        take it (it died, or refused): it is then stopped, for a fresh agent."""
        with self._lock:
            self._standby.discard(launch.node_id)
            node = self._nodes.get(launch.node_id)
        if node is None:
            return None
        try:
            port = self._serving(node)
            client = AgentClient(f"http://{_bracket(self.local.addr)}:{port}", self._token,
                                 timeout=ASSIGN_TIMEOUT)  # fmt: skip
            try:
                client.assign(AssignRequest(incarnation=launch.incarnation, peers=launch.peers))
            finally:
                client.close()
        except (RuntimeError, AgentError) as exc:
            logger.warning("%s: the standby agent cannot take the launch: %s", launch.node_id, exc)
            self._shutdown_node(launch.node_id)
            return None
        assert node.pid is not None
        return LaunchReply(pid=node.pid, port=port)

    def _took(self, node_id: str, node: LocalNode, standby: bool = False) -> None:
        with self._lock:
            self._nodes[node_id] = node
            self.launched.add(node_id)
            self._joined_launches.add(node_id)
            if standby:
                self._standby.add(node_id)
        if node.console is not None:
            threading.Thread(
                target=self._pump, args=(node.console,), daemon=True, name="tg-console"
            ).start()

    @staticmethod
    def _serving(node: LocalNode) -> int:
        """The port ``node``'s agent serves on, once it does; RuntimeError: it exited, or
        did not serve in time."""
        deadline = time.monotonic() + PORT_WAIT_SECONDS
        while (port := node.port()) is None:
            if (why := node.exited()) is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise RuntimeError(f"its agent did not serve within {PORT_WAIT_SECONDS:g}s")
            time.sleep(0.02)
        return port

    def _shutdown_node(self, node_id: str) -> None:
        with self._lock:
            node = self._nodes.pop(node_id, None)
            self._standby.discard(node_id)
        if node is not None:
            node.shutdown(None)  # no graceful API call: the controller made it, if it could

    def _shutdown_all(self) -> None:
        with self._lock:
            self._generation += 1  # before the list: a standby added later sees it
            ids = list(self._nodes)
        for node_id in ids:
            self._shutdown_node(node_id)

    def _pump(self, stream: IO[bytes]) -> None:
        """Copy an agent's console to ours, control characters shown as escapes
        (observe/terminal.py). A console that went away (a closed pipe) is dropped, and
        the agent's pipe still drained: the job goes on."""
        out = self._out
        try:
            for raw in iter(stream.readline, b""):
                if out is None:
                    continue
                try:
                    out.write(safe_bytes(raw).encode())
                    out.flush()
                except (OSError, ValueError):
                    out = None
        except (OSError, ValueError):
            pass  # the agent's pipe was closed under us at shutdown

    # -- HTTP to the controller ----------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request(path, json.dumps(body).encode())

    def _get(self, path: str, timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        return self._request(path, None, timeout)

    def _request(
        self, path: str, data: bytes | None, timeout: float = REQUEST_TIMEOUT
    ) -> dict[str, Any]:
        request = urllib.request.Request(
            self.controller_url + path,
            data=data,
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
            method="POST" if data is not None else "GET",
        )
        with urllib.request.urlopen(request, timeout=timeout, context=self._tls_client) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
            return answer


async def _in_thread(pool: ThreadPoolExecutor, call: Callable[[], Any]) -> Any:
    import asyncio

    return await asyncio.get_running_loop().run_in_executor(pool, call)


def partition_allowed() -> bool:
    """Whether this host serves ``POST /partition`` (a rehearsal taking its interface
    down): only where ``$TRAINGUARD_ALLOW_PARTITION`` is ``1``, never by default."""
    return os.environ.get(PARTITION_ENV) == "1"


def partition_unavailable(ifname: str | None) -> str | None:
    """Why this host cannot cut itself off (``--inject partition``), or None."""
    if ifname is None:
        return "this host's interface toward the controller is not known"
    if os.geteuid() != 0:
        return "taking an interface down needs root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def cut_off(ifname: str, seconds: float) -> None:
    """Take ``ifname`` down; up again after ``seconds``."""
    logger.warning("rehearsal: cutting this host off the network (%s down)", ifname)
    subprocess.run(["ip", "link", "set", ifname, "down"], check=False)
    time.sleep(seconds)
    subprocess.run(["ip", "link", "set", ifname, "up"], check=False)
    logger.warning("rehearsal: %s is up again after %g s", ifname, seconds)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))
    except (ValueError, OSError):
        return str(exc.reason)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
