"""Launching a job's nodes on the hosts that joined it (the controller's side).

:class:`HostsLauncher` is the :class:`~trainguard.platform.node.NodeLauncher` of a job on
several hosts: a node of the controller's own host is an agent subprocess as on one
machine (bound to this host's address, not loopback); a node of another host is asked of
that host's daemon (``POST /launch``), which starts the agent there and answers with its
port, and becomes a :class:`RemoteNode`. The local platform then talks to every agent the
same way, at its host's address.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable
from typing import IO, Any

from trainguard.agent.client import AgentClient, AgentError
from trainguard.health.suite import Peers
from trainguard.hosts.roster import HostRecord
from trainguard.hosts.service import HostsService
from trainguard.http_client import HTTPStatusError, call_json
from trainguard.platform.node import AgentLauncher, LaunchedNode, NoCapacity
from trainguard.wire.base import WireError
from trainguard.wire.hosts import LaunchReply, LaunchRequest, ShutdownRequest

__all__ = ["DaemonError", "HostsLauncher", "NoHost", "RemoteNode", "call_daemon"]

LAUNCH_TIMEOUT = 60.0  # the daemon answers once the agent serves (it imports no torch)
SHUTDOWN_TIMEOUT = 2.0


class DaemonError(OSError):
    """A host daemon did not do what it was asked (unreachable, refused, bad answer);
    ``status``: its HTTP status, when it answered one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NoHost(DaemonError, NoCapacity):
    """No host that joined can run the node now (every one busy, silent or fenced)."""


def call_daemon(
    url: str,
    path: str,
    token: str,
    body: dict[str, Any],
    timeout: float,
    tls: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    """POST ``body`` (JSON) to ``url + path`` with the job's token; the JSON answer."""
    try:
        return call_json(url.rstrip("/") + path, token, body, timeout=timeout, tls=tls)
    except HTTPStatusError as exc:
        raise DaemonError(str(exc), exc.status) from None
    except (OSError, ValueError) as exc:
        raise DaemonError(f"{url}{path}: {exc}") from None


class RemoteNode:
    """A node agent on another host, started by that host's daemon."""

    def __init__(
        self,
        node_id: str,
        incarnation: str,
        host: HostRecord,
        reply: LaunchReply,
        token: str,
        tls: ssl.SSLContext | None,
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self.host = host
        self.address = host.addr
        self.hostname = host.hostname
        self.remote_pid = reply.pid  # on its host: never signalled from here
        self._port = reply.port
        self._token = token
        self._tls = tls
        self.last_pids: tuple[int, ...] = ()  # its host's pids: not ours to kill

    @property
    def pid(self) -> int | None:
        return None  # not a process of this machine

    @property
    def console(self) -> IO[bytes] | None:
        return None  # its host's terminal shows its ranks' lines

    def port(self) -> int | None:
        return self._port

    def exited(self) -> str | None:
        return None  # a dead agent or host is found by its silence (control/contact.py)

    @property
    def fenced(self) -> bool:
        """Its host was fenced: nothing is asked of it any more (see :meth:`shutdown`)."""
        return self.host.lost

    def shutdown(self, client: AgentClient | None) -> None:
        """Ask the agent, then its host's daemon (which kills what is left).

        A fenced host (its node declared lost, or its lease gone stale) is not contacted:
        it stops its workers on its own when its next lease renewal says so, or after
        ``partitionTimeoutSeconds`` without one. Asking it would only hold up the launch
        of the node's replacement by the calls' timeouts (a cut-off host never answers).
        """
        if self.host.lost:
            return
        if client is not None:
            with contextlib.suppress(AgentError):
                client.shutdown()
        if self.host.daemon_url is not None:
            with contextlib.suppress(DaemonError):
                call_daemon(
                    self.host.daemon_url,
                    "/shutdown",
                    self._token,
                    ShutdownRequest(node_id=self.node_id).to_json(),
                    SHUTDOWN_TIMEOUT,
                    self._tls,
                )


class HostsLauncher:
    """Launches each node on the host that holds it (see the module doc)."""

    def __init__(
        self,
        service: HostsService,
        local: AgentLauncher,
        token: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.service = service
        self.local = local
        self._token = token
        self._tls = tls
        # The nodes the job runs now (the platform's), whose hosts are not idle.
        self.busy: Callable[[], set[str]] = set
        # Told of a node no host can run (a Slurm job requeues itself).
        self.on_no_host: Callable[[str], None] = lambda node_id: None

    def __call__(self, node_id: str, incarnation: str, peers: Peers | None = None) -> LaunchedNode:
        host = self.service.bind(node_id, self.busy() - {node_id})
        if host is None:
            self.on_no_host(node_id)
            raise NoHost(f"no host can run {node_id}: every host that joined is busy or silent")
        if host.local:
            return self.local(node_id, incarnation, peers)
        assert host.daemon_url is not None
        request = LaunchRequest(
            node_id=node_id,
            incarnation=incarnation,
            peers=(peers.rank, peers.world_size, peers.master_addr, peers.master_port)
            if peers is not None
            else None,
        )
        answer = call_daemon(
            host.daemon_url, "/launch", self._token, request.to_json(), LAUNCH_TIMEOUT, self._tls
        )
        try:
            reply = LaunchReply.from_json(answer, "launch")
        except WireError as exc:
            raise DaemonError(f"{host.daemon_url}/launch: {exc}") from None
        return RemoteNode(node_id, incarnation, host, reply, self._token, self._tls)
