"""What the controller's host adds to ``trainguard run`` when the job spans hosts.

The host that owns ``--rdzv-endpoint`` runs the job as on one machine
(:class:`~trainguard.platform.local.LocalRunner`), with these differences, gathered here
and in :class:`~trainguard.platform.across_hosts.AcrossHosts`: the server agents push
to listens on the endpoint (with the join and lease routes of
:class:`~trainguard.hosts.service.HostsService`), off loopback, so the job's token is
required; node 0 is this host's, its agent and every rendezvous at this host's address;
the other nodes are launched through their hosts' daemons
(:class:`~trainguard.hosts.launcher.HostsLauncher`); the run waits for the hosts to
join before the first attempt (``--join-timeout``); a node declared lost fences its host;
and at the end every host learns the job's exit code from its next lease.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.control.events import Event, EventKind, FaultType
from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.roster import Roster
from trainguard.hosts.service import HostsService
from trainguard.observe.summary import event_line

__all__ = ["LEASE_SECONDS", "ControllerHost", "interface_env"]

LEASE_SECONDS = 1.0  # how often host daemons renew their lease
AGENT_CONTACT_TIMEOUT = 2.0  # each poll or request to an agent on another host
END_LINGER_SECONDS = 5.0  # the most the server stays up for hosts to learn the job's end

_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_env(local: LocalAddress, user_env: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``: the interface that reaches the
    controller, unless the user set them (in the spec's env, or this environment)."""
    if local.ifname is None:
        return {}
    return {
        name: local.ifname
        for name in _IFNAME_VARS
        if name not in user_env and name not in os.environ
    }


@dataclass
class ControllerHost:
    """See the module doc."""

    endpoint: JobEndpoint
    local: LocalAddress
    token: str
    join_timeout: float
    partition_timeout: float
    tls_server: ssl.SSLContext | None = None
    tls_client: ssl.SSLContext | None = None
    tls_ca: str | None = None  # the CA file the agents check report URLs against
    service: HostsService | None = field(default=None, init=False)
    # More listeners of the controller's events (a Slurm job drains lost nodes).
    listeners: list[Callable[[Event], None]] = field(default_factory=list, init=False)

    def start(
        self,
        job_id: str,
        node_ids: tuple[str, ...],
        spare_ids: tuple[str, ...],
        growth_ids: tuple[str, ...],
        spec: dict[str, Any],
        durable_url: str,
        say: Any,
    ) -> HostsService:
        roster = Roster(node_ids, spare_ids, spec, growth_ids)
        hostname = socket.gethostname()
        roster.add_controller_host(
            f"{hostname}-{os.getpid()}", hostname, self.local.addr, self.local.ifname, time.time()
        )
        service = HostsService(
            roster,
            self.token,
            lease_seconds=LEASE_SECONDS,
            partition_timeout=self.partition_timeout,
            durable_url=durable_url,
            say=say,
        )
        service.job_id = job_id
        self.service = service
        return service

    def on_event(self, event: Event) -> None:
        """Every host prints the event (with its next lease); a node declared lost (or
        dropped for cause) fences its host."""
        if self.service is None:
            return
        self.service.publish(event_line(event))
        if event.kind != EventKind.FAULT or event.node is None:
            return
        kind = event.data.get("type")
        if kind in {t.value for t in FaultType if t.loses_node}:
            host = self.service.lose(event.node)
            if host is not None and host.lost:
                self.service.say(
                    f"host {host.hostname} ({host.addr}) fenced: {event.node} was declared lost"
                )

    def partition(self, node_id: str, seconds: float | None) -> str | None:
        """``--inject partition``: have ``node_id``'s host cut itself off; why not, or
        None."""
        from trainguard.hosts.launcher import DaemonError, call_daemon
        from trainguard.wire.hosts import MAX_PARTITION_SECONDS, PartitionRequest

        host = self.service.holder(node_id) if self.service is not None else None
        if host is None:
            return f"no host holds {node_id}"
        if host.daemon_url is None:
            return f"{node_id} runs on the controller's own host"
        try:
            cut = MAX_PARTITION_SECONDS if seconds is None else min(seconds, MAX_PARTITION_SECONDS)
            body = PartitionRequest(seconds=cut).to_json()
            call_daemon(host.daemon_url, "/partition", self.token, body, 5.0, self.tls_client)
        except DaemonError as exc:
            if exc.status == 404:  # the route is off (hosts/daemon.py partition_allowed)
                return f"{host.hostname} does not allow it (TRAINGUARD_ALLOW_PARTITION=1 there)"
            return str(exc)
        return None

    def finish(self, phase: str, exit_code: int, reason: str) -> None:
        """Tell every host how the job ended, and give them a lease or two to hear it."""
        if self.service is None:
            return
        ended = time.time()
        self.service.finish(phase, exit_code, reason)
        remote = [h for h in self.service.roster.hosts.values() if not h.local and not h.lost]
        deadline = time.monotonic() + END_LINGER_SECONDS
        while time.monotonic() < deadline:
            seen = {h.host_id for h in self.service.hosts_seen_since(ended)}
            if all(h.host_id in seen for h in remote):
                break
            time.sleep(0.1)
