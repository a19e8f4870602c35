"""A joining host's node agents: started, handed over, stopped (for :mod:`.daemon`).

:class:`HostAgents` starts an agent for each ``POST /launch`` (a relaunch replaces the
node's agent), copies every agent's console to this host's terminal, and stops them:
one node's on ``POST /shutdown``, all of them when the host is fenced or the job ends.

A spare host is kept warm (:meth:`HostAgents.warm_spare`): when it joins as a spare, the
spare node's agent starts at once as a standby (``--standby``). Its worker template
imports torch and the script's modules; it runs no check and no attempt. When the
controller launches that node here, the standby is only given the launch's incarnation
and peers (``POST /assign``), and the daemon answers with its port: the replacement of a
lost node does not wait for an interpreter, the agent's imports and ``import torch``. A
launch of another node id (the controller moved a lost node here under its own id)
stops the standby and starts a fresh agent, as does a standby that died or refused.

Fencing: :meth:`HostAgents.shutdown_all` counts a new ``generation`` before it lists the
agents, so a standby whose start was under way then stops as soon as it is up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import IO

from trainguard.agent.client import AgentClient, AgentError
from trainguard.health.suite import Peers
from trainguard.http_client import url_host
from trainguard.observe.terminal import safe_bytes
from trainguard.platform.node import AgentLauncher, LocalNode
from trainguard.wire.hosts import JoinReply, LaunchReply, LaunchRequest
from trainguard.wire.requests import AssignRequest

__all__ = ["PORT_WAIT_SECONDS", "HostAgents"]

logger = logging.getLogger(__name__)

PORT_WAIT_SECONDS = 60.0
ASSIGN_TIMEOUT = 5.0  # a standby agent takes its node (POST /assign): it only queues it


class HostAgents:
    """This host's node agents (see the module doc)."""

    def __init__(
        self,
        token: str,
        addr: str,
        first_launch: Callable[[JoinReply, str], None],
        out: IO[bytes] | None,
    ) -> None:
        """``addr``: where this host's agents serve; ``first_launch``: called before a
        node id's first agent since this host joined; ``out``: where their consoles go."""
        self._token = token
        self._addr = addr
        self._first_launch = first_launch
        self._out = out
        self._lock = threading.Lock()
        self._starting = threading.Lock()  # one agent start (or standby's) at a time
        self.nodes: dict[str, LocalNode] = {}
        self.launched: set[str] = set()  # every node id this host ran: its memory tier's name
        self._joined_launches: set[str] = set()  # those since the last join
        self._standby: set[str] = set()  # node ids whose agent waits, warm, for its launch
        # One more each time every agent is stopped (fenced, the job's end): a standby
        # that comes up after that stops at once.
        self.generation = 0

    def joined(self) -> None:
        """The host joined (again, after a fence: as a new host)."""
        self._joined_launches = set()

    def launch(
        self, launcher: AgentLauncher, reply: JoinReply, launch: LaunchRequest
    ) -> LaunchReply:
        """The agent of ``launch``: its standby's, given the launch, or a fresh one."""
        with self._starting:
            with self._lock:
                others = self._standby - {launch.node_id}
            for node_id in others:  # a standby of another node id is of no use now
                self.shutdown_node(node_id)
            if launch.node_id in self._standby and (taken := self._assign(launch)) is not None:
                return taken
            return self._fresh(launcher, reply, launch)

    def warm_spare(self, launcher: AgentLauncher, reply: JoinReply, generation: int) -> bool:
        """Start the spare node's agent as a standby, unless every agent was stopped
        since ``generation`` (fenced, or the job ended); whether it is up."""
        node_id = reply.node_id
        with self._starting:
            if self.generation != generation:
                return False  # fenced (and maybe joined again) since: a new join warms its own
            self._first_launch(reply, node_id)
            try:
                node = launcher(node_id, f"{node_id}.standby", None, standby=True)
            except OSError as exc:
                logger.warning("the spare's standby agent could not start: %s", exc)
                return False  # its launch starts a fresh agent
            self._took(node_id, node, standby=True)
            try:
                self._serving(node)
            except RuntimeError as exc:
                logger.warning("%s: the standby agent of this spare host failed: %s", node_id, exc)
                self.shutdown_node(node_id)
                return False
        with self._lock:
            stale = self.generation != generation
        if stale:  # fenced while it started: it must not outlive that
            self.shutdown_node(node_id)
            return False
        return True

    def shutdown_node(self, node_id: str) -> None:
        with self._lock:
            node = self.nodes.pop(node_id, None)
            self._standby.discard(node_id)
        if node is not None:
            node.shutdown(None)  # no graceful API call: the controller made it, if it could

    def shutdown_all(self) -> None:
        with self._lock:
            self.generation += 1  # before the list: a standby added later sees it
            ids = list(self.nodes)
        for node_id in ids:
            self.shutdown_node(node_id)

    # -- internals -----------------------------------------------------------------------

    def _fresh(
        self, launcher: AgentLauncher, reply: JoinReply, launch: LaunchRequest
    ) -> LaunchReply:
        self.shutdown_node(launch.node_id)  # a relaunch replaces the node's agent
        if launch.node_id not in self._joined_launches:  # after a fence too: a new host
            self._first_launch(reply, launch.node_id)
        peers = Peers(*launch.peers) if launch.peers is not None else None
        node = launcher(launch.node_id, launch.incarnation, peers)
        self._took(launch.node_id, node)
        port = self._serving(node)
        pid = node.pid
        assert pid is not None
        return LaunchReply(pid=pid, port=port)

    def _assign(self, launch: LaunchRequest) -> LaunchReply | None:
        """Give ``launch.node_id``'s standby agent its incarnation; None when it cannot
        take it (it died, or refused): it is then stopped, for a fresh agent."""
        with self._lock:
            self._standby.discard(launch.node_id)
            node = self.nodes.get(launch.node_id)
        if node is None:
            return None
        try:
            port = self._serving(node)
            host = url_host(self._addr)
            client = AgentClient(f"http://{host}:{port}", self._token, timeout=ASSIGN_TIMEOUT)
            try:
                client.assign(AssignRequest(incarnation=launch.incarnation, peers=launch.peers))
            finally:
                client.close()
        except (RuntimeError, AgentError) as exc:
            logger.warning("%s: the standby agent cannot take the launch: %s", launch.node_id, exc)
            self.shutdown_node(launch.node_id)
            return None
        assert node.pid is not None
        return LaunchReply(pid=node.pid, port=port)

    def _took(self, node_id: str, node: LocalNode, standby: bool = False) -> None:
        with self._lock:
            self.nodes[node_id] = node
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
