"""The local platform's nodes: one agent subprocess each, and the seam to launch others.

:class:`LocalPlatform <trainguard.platform.local.LocalPlatform>` launches a node through
a :class:`NodeLauncher`, by default :class:`AgentLauncher` (``python -m
trainguard.agent``). Anything with the :class:`LaunchedNode` interface will do: the
scale benchmark launches simulated agents (``bench/fleet.py``) through the same seam.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from trainguard.agent.client import AgentClient, AgentError
from trainguard.agent.jobenv import encode_job_env
from trainguard.agent.warm import WARM_STARTS, StartOptions
from trainguard.health.settings import HealthSettings
from trainguard.health.suite import Peers
from trainguard.platform.procs import kill_group, kill_recorded, pin
from trainguard.spec.plan import NodeGroupPlan

__all__ = [
    "AGENT_SHUTDOWN_SECONDS",
    "AgentLauncher",
    "HealthLaunch",
    "LaunchedNode",
    "LocalNode",
    "NoCapacity",
    "NodeLauncher",
    "WorkerPids",
]

# Time an agent gets to exit after /shutdown before it is killed.
AGENT_SHUTDOWN_SECONDS = 15.0


class NoCapacity(OSError):
    """The launcher has nowhere to run the node now, and may later (a job across hosts
    whose node's host was lost: another may join, or the same one rejoin)."""


class LaunchedNode(Protocol):
    """One launched node agent, as the local platform tracks it."""

    node_id: str
    incarnation: str
    # Its workers' pids as last seen: killed with the agent, in case it could not.
    last_pids: tuple[int, ...]
    # Where its agent serves (127.0.0.1 on one machine; its host's address on several).
    address: str
    # The machine its agent and workers run on, by name (``describe`` shows it).
    hostname: str

    @property
    def pid(self) -> int | None:
        """The agent's process id (where it is a process of its own)."""

    @property
    def console(self) -> IO[bytes] | None:
        """The agent's console (its workers' lines), to copy to the job's; None: none."""

    def port(self) -> int | None:
        """The port the agent serves on, once it does."""

    def exited(self) -> str | None:
        """Why the agent is gone, once it is (None while it runs)."""

    def shutdown(self, client: AgentClient | None) -> None:
        """Ask the agent to exit (through ``client``); kill it, and what it left, if not."""


class NodeLauncher(Protocol):
    def __call__(self, node_id: str, incarnation: str, peers: Peers | None = None) -> LaunchedNode:
        """Launch an agent for ``node_id`` that reports ``incarnation`` in its status;
        ``peers``: its place among the nodes launched with it (the connectivity check)."""


@dataclass(frozen=True)
class HealthLaunch:
    """What every agent gets of the job's health checks (``--health*`` flags)."""

    options: HealthSettings
    hooks_root: Path  # <hooks_root>/<node id>: each agent's rehearsal hooks
    fail: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # node id -> checks

    def agent_flags(self, node_id: str, peers: Peers | None) -> list[str]:
        flags = ["--health", self.options.to_json()]
        flags += ["--health-hooks", str(self.hooks_root / node_id)]
        for check in self.fail.get(node_id, ()):
            flags += ["--health-fail", check]
        if peers is not None and "connectivity" in self.options.checks:
            where = f"{peers.rank},{peers.world_size},{peers.master_addr},{peers.master_port}"
            flags += ["--health-peers", where]
        return flags


class WorkerPids:
    """A launched node's worker pids as last seen in its status, each with the start time
    taken when the pid was first seen (``procs.pin``): shared by :class:`LocalNode` and
    :class:`~trainguard.platform.resume.AdoptedNode`."""

    def __init__(self) -> None:
        self._workers: dict[int, str | None] = {}  # worker pid -> its start time

    @property
    def last_pids(self) -> tuple[int, ...]:
        return tuple(self._workers)

    @last_pids.setter
    def last_pids(self, pids: tuple[int, ...]) -> None:
        self._workers = pin(pids, self._workers)

    def kill_workers(self) -> None:
        """SIGKILL each worker still the process seen with its pid (never a later one)."""
        for pid, started in self._workers.items():
            kill_recorded(pid, started)


class LocalNode(WorkerPids):
    """One node agent subprocess (see :class:`AgentLauncher`)."""

    def __init__(
        self,
        node_id: str,
        incarnation: str,
        process: subprocess.Popen[bytes],
        port_file: Path,
        address: str = "127.0.0.1",
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        self.process = process
        self.port_file = port_file
        self.address = address
        self.hostname = socket.gethostname()
        super().__init__()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def console(self) -> IO[bytes] | None:
        return self.process.stdout

    def port(self) -> int | None:
        try:
            return int(self.port_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def exited(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        log = self.port_file.with_name(f"{self.node_id}.log")
        return f"its agent process exited with code {code}; see {log}"

    def shutdown(self, client: AgentClient | None) -> None:
        if self.process.poll() is None and client is not None:
            try:
                client.shutdown()
                self.process.wait(AGENT_SHUTDOWN_SECONDS)
            except (AgentError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            kill_group(self.process.pid)  # a child not yet reaped: its pid is still its own
            self.process.wait()
        # Workers die with their agent (PDEATHSIG); this covers an agent that was SIGKILLed
        # before it could arm that for a worker. Only a worker that is still the process
        # first seen with its pid is signalled, never a later one reusing the pid.
        self.kill_workers()
        if self.process.stdout is not None:
            with contextlib.suppress(OSError):
                self.process.stdout.close()


class AgentLauncher:
    """Launches ``python -m trainguard.agent`` for a node of the job, on loopback."""

    def __init__(
        self,
        job_dir: Path,
        token_file: Path,
        groups: dict[str, NodeGroupPlan],
        env: dict[str, dict[str, str]],
        start: StartOptions = WARM_STARTS,
        controller_grace: float = 0.0,
        health: HealthLaunch | None = None,
        host: str = "127.0.0.1",
        fence_after: float | None = None,
        tls_ca: str | None = None,
    ) -> None:
        """``groups``: each node id's group; ``env``: each node id's extra agent env;
        ``start``: how the agents start their workers (warm or fresh); ``health``: the
        job's health checks and monitors; ``host``: the address the agents bind (a job
        on several hosts: this host's address toward the controller); ``fence_after``: the
        agents' ``--fence-after`` (agent/lease.py; None on one machine)."""
        self.host = host
        self.fence_after = fence_after
        self.tls_ca = tls_ca  # the agents check an https report URL against it
        self.job_dir = job_dir
        self.token_file = token_file
        self.groups = groups
        self.env = env
        self.start = start
        self.controller_grace = controller_grace  # agents outlive this process so long
        self.health = health

    def __call__(
        self, node_id: str, incarnation: str, peers: Peers | None = None, standby: bool = False
    ) -> LocalNode:
        """``standby``: a spare host's agent, started before it is needed (``--standby``:
        it waits for ``POST /assign``; hosts/daemon.py)."""
        group = self.groups[node_id]
        agents_dir = self.job_dir / "agents"
        agents_dir.mkdir(parents=True, exist_ok=True)
        port_file = agents_dir / f"{node_id}.port"
        port_file.unlink(missing_ok=True)  # a replaced agent's port is not ours
        argv = [
            sys.executable,
            "-m",
            "trainguard.agent",
            "--node-id",
            node_id,
            "--incarnation",
            incarnation,
            "--token-file",
            str(self.token_file),
            "--host",
            self.host,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--log-dir",
            str(self.job_dir / "logs"),
            "--parent-pid",
            str(os.getpid()),
            "--controller-grace",
            f"{self.controller_grace:g}",
            "--cwd",
            group.working_dir or os.getcwd(),
        ]
        # The job's env (secrets among it) through the agent's environment, which only its
        # user can read, never its argv (everybody's `ps`); the rest is inherited (AWS_*...).
        job_env = encode_job_env({**group.env, **self.env.get(node_id, {})})
        if self.health is not None:
            argv += self.health.agent_flags(node_id, peers)
        if self.fence_after is not None:
            argv += ["--fence-after", f"{self.fence_after:g}"]
        if self.tls_ca is not None:
            argv += ["--tls-ca", self.tls_ca]
        if standby:
            argv.append("--standby")
        argv += [*self.start.agent_flags(), "--", *group.command]
        with open(agents_dir / f"{node_id}.log", "ab") as agent_log:
            process = subprocess.Popen(
                argv,
                env={**os.environ, **job_env},
                stdout=subprocess.PIPE,
                stderr=agent_log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the controller, which stops the agents
            )
        return LocalNode(node_id, incarnation, process, port_file, self.host)
