"""A joining host's side of a multi-host job: ``trainguard run ... --rdzv-endpoint`` on a
host that does not own the endpoint.

:class:`HostDaemon` joins the controller (retrying until ``--join-timeout``), serves
``POST /launch`` and ``POST /shutdown`` for it (node agents on this host, bound to the
address that reaches the controller), copies its agents' console (its ranks' lines) to
this terminal, and renews its lease every ``lease_seconds``. It ends with the job: when
a lease says the job finished, the process exits with the job's exit code.

A host that joins as a spare is kept warm: the spare node's agent starts at once as a
standby, and the node's launch only hands it its incarnation (:mod:`.host_agents`).

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

import logging
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from aiohttp import web

from trainguard.auth import bearer_ok
from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.host_agents import PORT_WAIT_SECONDS, HostAgents
from trainguard.http_client import HTTPStatusError, call_json, url_host
from trainguard.http_server import RouteServer
from trainguard.platform.node import AgentLauncher
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

__all__ = ["EXIT_JOIN_REFUSED", "EXIT_LOST_CONTROLLER", "HostDaemon", "JoinError"]

logger = logging.getLogger(__name__)

EXIT_JOIN_REFUSED = 2  # the controller turned this host down: a usage error
EXIT_LOST_CONTROLLER = 1
PARTITION_ENV = "TRAINGUARD_ALLOW_PARTITION"  # "1": --inject partition may cut this host off
JOIN_RETRY_SECONDS = 0.5
JOIN_QUIET_SECONDS = 10.0  # a join unanswered this long is said, and again every:
JOIN_REMIND_SECONDS = 30.0
REQUEST_TIMEOUT = 5.0


class JoinError(RuntimeError):
    """The controller refused this host (the message says why), or never answered."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class HostDaemon:
    """One joining host's part in a job (see the module doc)."""

    def __init__(
        self,
        endpoint: JobEndpoint,
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
        self._on_progress = on_progress
        self.progress: tuple[str, int] | None = None  # the newest lease's phase, restarts
        self.node_rank = node_rank
        self.join_timeout = join_timeout
        self._tls_client = tls_client
        self._say = say
        scheme = "https" if tls_client is not None else "http"
        self.controller_url = f"{scheme}://{url_host(endpoint.host)}:{endpoint.port}"
        self._lock = threading.Lock()
        self.agents = HostAgents(token, local.addr, first_launch, out)
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

    @property
    def launched(self) -> set[str]:
        """Every node id this host ran: its memory tier's name."""
        return self.agents.launched

    # -- the run -------------------------------------------------------------------------

    def run(self) -> int:
        """Join, then keep the lease until the job ends; the exit code to end with."""
        try:
            while True:
                self._ready.clear()
                try:
                    self.reply = reply = self.join()
                    self.agents.joined()
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
                    self._pool.submit(self._warm_spare, reply, self.agents.generation)
                outcome = self._keep_lease(reply)
                if isinstance(outcome, int):
                    return outcome
                self._say(outcome)  # fenced: join again, as a new host
        finally:
            self.agents.shutdown_all()
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
            except HTTPStatusError as exc:
                if exc.status in (401, 409, 400):
                    raise JoinError(
                        f"the controller refused this host: {exc.detail}", True
                    ) from None
                last = f"HTTP {exc.status}: {exc.detail}"
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
            except (OSError, ValueError, WireError) as exc:
                cut_for = time.monotonic() - last_ok
                if cut_for >= reply.partition_timeout:
                    self.agents.shutdown_all()
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
                self.agents.shutdown_all()
                self._say(f"job {reply.job_id} ended: {lease.reason} (exit {lease.exit_code})")
                return lease.exit_code if lease.exit_code is not None else EXIT_LOST_CONTROLLER
            if lease.standing == "lost":
                self.agents.shutdown_all()
                return (
                    f"the controller declared {reply.node_id} lost: this host's workers are "
                    "stopped; joining again as a new host"
                )

    # -- the routes ----------------------------------------------------------------------

    async def _launch(self, request: web.Request) -> web.Response:
        if not bearer_ok(request.headers.get("Authorization"), self._token):
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
        if not bearer_ok(request.headers.get("Authorization"), self._token):
            return _error(401, "missing or wrong bearer token")
        try:
            stop = parse_json(ShutdownRequest, await request.read(), "shutdown")
        except WireError as exc:
            return _error(400, str(exc))
        await _in_thread(self._pool, lambda: self.agents.shutdown_node(stop.node_id))
        return web.json_response({"accepted": True}, status=202)

    async def _partition(self, request: web.Request) -> web.Response:
        """A rehearsal (``--inject partition``): this host cuts itself off the network."""
        if not bearer_ok(request.headers.get("Authorization"), self._token):
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
        launcher, reply = self._launcher, self.reply
        assert launcher is not None and reply is not None
        return self.agents.launch(launcher, reply, launch)

    def _warm_spare(self, reply: JoinReply, generation: int) -> None:
        launcher = self._launcher
        if launcher is not None and self.agents.warm_spare(launcher, reply, generation):
            self._say(
                f"{reply.node_id}: this spare host's agent is up, idle until the job needs it"
            )

    # -- HTTP to the controller ----------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request(path, body)

    def _get(self, path: str, timeout: float = REQUEST_TIMEOUT) -> dict[str, Any]:
        return self._request(path, None, timeout)

    def _request(
        self, path: str, body: dict[str, Any] | None, timeout: float = REQUEST_TIMEOUT
    ) -> dict[str, Any]:
        url = self.controller_url + path
        return call_json(url, self._token, body, timeout=timeout, tls=self._tls_client)


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
