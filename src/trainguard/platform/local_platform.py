"""The local platform: every node of a job is an agent process on this machine.

It implements :class:`~trainguard.platform.base.Platform` for
:func:`~trainguard.platform.drive.drive`: it launches agents (through a
:class:`~trainguard.platform.node.NodeLauncher`), finds their ports, knows when their
processes exit, talks to them through an
:class:`~trainguard.platform.transport.AgentTransport`, and records the job in the
SQLite store (one transaction per turn, only the rows that changed). The ``--inject``
faults are a hook of the loop (:mod:`trainguard.platform.inject_hook`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent.client import AgentError
from trainguard.agent.logs import orphaned_console
from trainguard.checkpoint.tier_dir import private_dir
from trainguard.control.actions import LaunchNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.contact import Contact, shown_state
from trainguard.control.controller import JobController
from trainguard.control.events import Event
from trainguard.control.reports import NodeReport, Refusal
from trainguard.health.suite import Peers
from trainguard.http_client import url_host
from trainguard.observe.job import JobObserver
from trainguard.observe.live import LiveLine
from trainguard.observe.summary import event_line
from trainguard.platform.base import Cancel, Observation, Replace
from trainguard.platform.book import ReportBook
from trainguard.platform.doorbell import Doorbell
from trainguard.platform.follow import FollowedFile, LineSource
from trainguard.platform.node import LaunchedNode, NoCapacity, NodeLauncher
from trainguard.platform.procs import free_port, start_time
from trainguard.platform.store import JobAsks, NodeRow, Store
from trainguard.platform.transport import AgentTransport, Delivery
from trainguard.rendezvous.client import StoreServiceHandle
from trainguard.wire.requests import AssignRequest
from trainguard.wire.status import WorkerState

__all__ = ["HostsWiring", "LocalPlatform"]

FOLLOWER_DRAIN_SECONDS = 10.0  # an adopted agent's last console lines, at the end

logger = logging.getLogger(__name__)

SHUTDOWN_CONCURRENCY = 64
LOCATE_INTERVAL = 0.02  # how often the loop looks for a starting agent's port file (s)
FAST_LOCATE_MAX = 64  # more starting agents than this: found at the loop's own pace
# What the store's ``desired`` asks of a running job, and the reason it is stopped with.
STOP_REQUESTS = {"delete": "deleted by user", "stop": "stopped by user"}


@dataclass(frozen=True)
class HostsWiring:
    """A job on several hosts, as its platform sees it (given at construction)."""

    # Told every event the controller records (the host of a node declared lost is
    # fenced), and the job's phase and restarts when they change (every host gets them
    # with its lease).
    listeners: Sequence[Callable[[Event], None]]
    progress_listeners: Sequence[Callable[[str, int], None]]
    # Cuts a node's host off the network for so many seconds (None: for good); why it
    # could not, or None.
    partitioner: Callable[[str, float | None], str | None]
    # An elastic job's capacity, from the nodes running: the hosts that renew their
    # lease, and the running nodes whose host went silent (cut off); None: not elastic.
    capacity_of: Callable[[set[str]], tuple[int, tuple[str, ...]]] | None = None
    # How long a node no host can run yet waits for one to join (0: lost at once).
    host_wait: float = 0.0


class LocalPlatform:
    """One job's nodes on this machine; see the module docstring."""

    def __init__(
        self,
        job_id: str,
        store: Store,
        transport: AgentTransport,
        launcher: NodeLauncher,
        *,
        memory_root: Path,
        hooks_root: Path | None = None,
        preempt_grace: float | None = None,
        say: Callable[[str], None],
        pump: Callable[[LineSource], None],
        interrupted: Callable[[], str | None],
        observer: JobObserver | None = None,
        live: LiveLine | None = None,
        address: str = "127.0.0.1",
        hosts: HostsWiring | None = None,
    ) -> None:
        """``address``: this host's address where other hosts reach it (a job on several
        hosts; node 0 is this host's, so every attempt's rendezvous is here); ``hosts``:
        how a job on several hosts is wired in (None: one machine)."""
        self.address = address
        self.listeners = list(hosts.listeners) if hosts else []
        self.progress_listeners = list(hosts.progress_listeners) if hosts else []
        self.capacity_of = hosts.capacity_of if hosts else None
        self.partitioner = hosts.partitioner if hosts else None
        # A stop decided outside the controller (no host left to run a node), taken at
        # the next look.
        self.cancel: Cancel | None = None
        # How long a node no host can run yet waits for one (ControlConfig.host_wait; 0:
        # lost at once), and the nodes waiting: their incarnation and peers, looked for
        # a host again at every turn.
        self.host_wait = hosts.host_wait if hosts else 0.0
        self._awaiting: dict[str, tuple[str, Peers]] = {}
        # The job's log directory, where adopted agents write their orphaned console.
        self.console_dir: Path | None = None
        # The job's rendezvous store service (None: rank 0 hosts each attempt's store).
        self.rendezvous: StoreServiceHandle | None = None
        self._doorbell: Doorbell | None = None  # asks from other terminals wake the loop
        self._closed = threading.Event()
        self._followers: list[threading.Thread] = []
        self.job_id = job_id
        self.store = store
        self.transport = transport
        self.book: ReportBook = transport.book
        self.launcher = launcher
        self.memory_root = memory_root
        self.hooks_root = hooks_root  # each agent's rehearsal hooks (xid, disk-full)
        # Elastic jobs (None: not elastic): how long a preempted node lives on, and when
        # each preempted node's time is up.
        self.preempt_grace = preempt_grace
        self._preempted: dict[str, float] = {}
        self.nodes: dict[str, LaunchedNode] = {}  # the live agent of each node id
        self._unlocated: set[str] = set()  # launched, port not known yet
        self.say = self._say = say  # a line to the user
        self._pump = pump  # copies an agent's console to the job's
        self._interrupted = interrupted
        self.observer = observer  # samples for the store, metrics
        self._live = live  # the live line on the terminal, if one
        self._launches = 0
        self._replacements_seen = 0  # node replacement requests handed on so far
        self._written: dict[str, object] = {}  # what the store has, by row key
        self._announced: list[Event] = []  # events told this turn, to be stored
        # Each node's recorded pids (agent, workers) and their start times, read once per pid.
        self._pid_starts: dict[str, tuple[tuple[int | None, ...], tuple[str | None, ...]]] = {}

    # -- lifecycle ---------------------------------------------------------------------

    def endpoint(self, attempt: int, node_id: str) -> StoreEndpoint:
        """A fresh store per attempt, so no stale peer addresses: the job's store
        service's (:mod:`trainguard.rendezvous`), else one rank 0 hosts on a fresh port."""
        if self.rendezvous is not None and (port := self.rendezvous.open(attempt)) is not None:
            return StoreEndpoint(self.address, port, hosted=True)
        return StoreEndpoint(self.address, free_port(self.address))

    def launch(self, request: LaunchNodes) -> None:
        """Start a fresh agent per node, replacing a live one (one host: nothing to avoid);
        a node of ``request.keep`` whose live agent is idle keeps it instead, given the
        new incarnation (its worker template stays warm; :meth:`_assign_again`)."""
        incarnations = {n: f"{n}.{self._launches + i + 1}" for i, n in enumerate(request.node_ids)}
        self._launches += len(request.node_ids)
        kept = {n for n in request.keep if self._assign_again(n, incarnations[n])}
        self._shutdown([n for n in request.node_ids if n in self.nodes and n not in kept])
        port, world = free_port(self.address), len(request.node_ids)  # connectivity check's
        for rank, node_id in enumerate(request.node_ids):
            incarnation = incarnations[node_id]
            # <node>/memory: the node's own tier; <node>/replicas: its copies of its peers'.
            private_dir(self.memory_root / node_id / "memory")  # 0700 (tier_dir.py)
            self.book.reset(node_id, incarnation)
            self._awaiting.pop(node_id, None)
            if node_id in kept:
                self._unlocated.add(node_id)  # the same agent: located at the next wait
                continue
            self._launch_one(node_id, incarnation, Peers(rank, world, self.address, port))

    def _assign_again(self, node_id: str, incarnation: str) -> bool:
        """Whether ``node_id``'s live agent took ``incarnation`` (``POST /assign`` with
        ``again``): only an agent that runs, on a host not fenced, and idle (it refuses
        otherwise). One that cannot is replaced by a fresh agent, as without ``keep``."""
        node = self.nodes.get(node_id)
        client = self.transport.client(node_id)
        if node is None or client is None or node.exited() is not None or self._fenced(node_id):
            return False
        try:
            client.assign(AssignRequest(incarnation=incarnation, again=True))
        except AgentError as exc:
            logger.info("%s: its agent is not kept (%s): a fresh one is launched", node_id, exc)
            return False
        node.incarnation = incarnation
        logger.info("%s: its live agent is kept, as %s", node_id, incarnation)
        return True

    def _launch_one(
        self, node_id: str, incarnation: str, peers: Peers, waited: bool = False
    ) -> None:
        """Start ``node_id``'s agent; with no host for it yet, wait for one (``host_wait``:
        looked for again at every turn, :meth:`_launch_awaiting`)."""
        try:
            node = self.launcher(node_id, incarnation, peers)
        except NoCapacity as exc:
            if self.host_wait <= 0:
                self.book.gone(node_id, f"its agent could not be launched: {exc}")
            elif not waited:
                self._awaiting[node_id] = (incarnation, peers)
                self.book.awaiting_host(node_id, time.time())
                self._say(
                    f"{exc}: {node_id} waits up to {self.host_wait:g}s (--join-timeout) "
                    "for a host to join or rejoin"
                )
            return
        except OSError as exc:
            self._awaiting.pop(node_id, None)
            self.book.gone(node_id, f"its agent could not be launched: {exc}")
            return
        if waited:
            self._awaiting.pop(node_id, None)
            self.book.reset(node_id, incarnation, launched_at=time.time())
            self._say(f"{node_id}: a host can run it now; launching its agent")
        self.nodes[node_id] = node
        self._unlocated.add(node_id)
        console = node.console
        if console is not None:
            threading.Thread(
                target=self._pump,
                args=(console,),
                daemon=True,
                name=f"console-{node_id}",
            ).start()

    def _launch_awaiting(self) -> None:
        """The nodes that wait for a host: launched as soon as one can run them."""
        for node_id, (incarnation, peers) in list(self._awaiting.items()):
            self._launch_one(node_id, incarnation, peers, waited=True)

    def adopt(self, nodes: Sequence[LaunchedNode], urls: Sequence[str]) -> None:
        """Take over agents a dead controller launched (``trainguard resume``); their
        workers' lines, which went to the dead controller's pipe, are followed in the
        file each agent writes them to since (from the first one the pipe refused)."""
        for node, url in zip(nodes, urls, strict=True):
            self.book.reset(node.node_id, node.incarnation)
            self.book.located(node.node_id, url, "localhost")
            self.nodes[node.node_id] = node
            if self.console_dir is not None:
                orphaned = FollowedFile(
                    orphaned_console(self.console_dir, node.node_id), self._closed
                )
                follower = threading.Thread(
                    target=self._pump, args=(orphaned,), daemon=True,
                    name=f"console-{node.node_id}",
                )  # fmt: skip
                follower.start()
                self._followers.append(follower)
        # New agents get incarnations the dead controller never gave ("<node>.<launch>").
        suffixes = [n.incarnation.rpartition(".")[2] for n in nodes]
        self._launches = max([self._launches, *(int(x) for x in suffixes if x.isdigit())])

    def retire(self, node_ids: Sequence[str]) -> None:
        self._shutdown(node_ids)
        for node_id in node_ids:
            self._awaiting.pop(node_id, None)
            self.book.forget(node_id)

    def answer_doorbell(self, job_dir: Path) -> None:
        """Wake the loop when another terminal writes an ask to the store and rings the
        job's doorbell (:mod:`trainguard.platform.doorbell`): it is read at once, not at
        the next turn (up to a quiet poll's 2 s later)."""
        self._doorbell = Doorbell.open(job_dir, self.book.wake)

    def close(self) -> None:
        """Shut every agent down (the job ended, or the runner is going away)."""
        if self._doorbell is not None:
            self._doorbell.close()  # asks from now on wait for the next controller
        self._shutdown(list(self.nodes))
        self._closed.set()  # the agents are gone: the followers read what they left
        for follower in self._followers:
            follower.join(FOLLOWER_DRAIN_SECONDS)
        self.transport.close()
        if self.rendezvous is not None:
            self.rendezvous.shutdown()

    def _shutdown(self, node_ids: Sequence[str]) -> None:
        nodes = [(n, node) for n in node_ids if (node := self.nodes.pop(n, None)) is not None]
        if not nodes:
            return
        with ThreadPoolExecutor(min(SHUTDOWN_CONCURRENCY, len(nodes))) as pool:
            for node_id, node in nodes:
                pool.submit(node.shutdown, self.transport.client(node_id))

    # -- transport ---------------------------------------------------------------------

    def send(self, deliveries: Sequence[Delivery]) -> list[Refusal]:
        """Deliver the requests, but none to a node whose host is fenced (a job across
        hosts: its node was declared lost, or its lease went stale). It cannot answer,
        and its calls' timeouts and retries would hold the loop up for seconds (the
        replacement's launch with it); its host stops its workers on its own."""
        return self.transport.send([d for d in deliveries if not self._fenced(d.node_id)])

    def _fenced(self, node_id: str) -> bool:
        return getattr(self.nodes.get(node_id), "fenced", False) is True

    def wait(self, timeout: float) -> None:
        """Until news, ``timeout``, or (while agents start) one of them serves: an agent
        is asked for its status the moment its port is known, not a poll later."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self._unlocated or len(self._unlocated) > FAST_LOCATE_MAX:
                self.book.wait(left)
                return
            if self.book.wait(min(left, LOCATE_INTERVAL)) or self._located():
                return

    def pace(self, interval: float) -> None:
        self.transport.pace(interval)

    def observe(self, now: float) -> Observation:
        if self._awaiting:
            self._launch_awaiting()
        located = [n for n in list(self._unlocated) if self._locate(n)]
        if located:
            self.transport.poll(located)  # its answer is in this turn's reports
        for node_id, node in self.nodes.items():
            if (why := node.exited()) is not None:
                self.book.gone(node_id, why)
        cancel = None
        job = self.store.asks(self.job_id)
        if (why := self._interrupted()) is not None:  # Ctrl-C, SIGTERM
            cancel = Cancel(why)
        elif self.cancel is not None:
            cancel = self.cancel
        elif (asked := STOP_REQUESTS.get(job.desired or "")) is not None:  # delete, stop
            cancel = Cancel(asked)
        self._take_preempted(now)
        capacity = job.capacity if self.preempt_grace is not None else None
        preempted, taken_as = tuple(self._preempted), "preempted"
        if self.capacity_of is not None:
            capacity, preempted = self.capacity_of(set(self.nodes))
            taken_as = "cut off (its host went silent)"
        return Observation(
            self.book.reports(),
            cancel,
            replace=self._replace_requests(job),
            capacity=capacity,
            preempted=preempted,
            taken_as=taken_as,
        )

    def preempt(self, node_id: str, now: float) -> None:
        """``node_id``'s capacity is taken away (``--inject preempt``): it has the grace
        of a preempted node to leave, then it is taken (:meth:`_take_preempted`)."""
        self.store.set_capacity(self.job_id, -1, delta=True)
        self._preempted[node_id] = now + (self.preempt_grace or 0.0)

    def _take_preempted(self, now: float) -> None:
        """A preempted node still in the job when its grace is over is taken: its agent
        and workers are killed (the controller then sees it lost)."""
        for node_id, deadline in list(self._preempted.items()):
            if node_id not in self.nodes:
                del self._preempted[node_id]  # given up in time
            elif now >= deadline:
                del self._preempted[node_id]
                self._say(f"{node_id} preempted: its agent and workers are killed")
                self._shutdown([node_id])
                self.book.gone(node_id, "preempted (its capacity was taken away)")

    def _replace_requests(self, job: JobAsks) -> list[Replace]:
        """The node replacements asked for since the last look (`trainguard node replace`)."""
        try:
            requests = json.loads(job.node_requests)
        except ValueError:
            return []
        new = requests[self._replacements_seen :]
        self._replacements_seen = len(requests)
        return [Replace(str(node), f"asked for by hand: {why}") for node, why in new]

    def _located(self) -> bool:
        """Whether a starting agent's port file has appeared."""
        return any(
            (node := self.nodes.get(n)) is not None and node.port() is not None
            for n in self._unlocated
        )

    def _locate(self, node_id: str) -> bool:
        """Note where the node's agent serves, once it does; True when it just did."""
        node = self.nodes.get(node_id)
        if node is None:
            self._unlocated.discard(node_id)
        elif (port := node.port()) is not None:
            url = f"http://{url_host(node.address)}:{port}"
            self.book.located(node_id, url, self.host_of(node))
            self._unlocated.discard(node_id)
            return True
        return False

    @staticmethod
    def host_of(node: LaunchedNode) -> str:
        """The host a node's agent runs on, by its address (new nodes avoid bad hosts)."""
        return "localhost" if node.address in ("127.0.0.1", "::1") else node.address

    # -- the record ----------------------------------------------------------------------

    def announce(self, controller: JobController) -> None:
        """Say the new events and hand them to the listeners (a lost node's host is fenced
        before its replacement is launched); :meth:`record` stores them."""
        events = controller.drain_events()
        for event in events:
            self._say(event_line(event))
            for listener in self.listeners:
                listener(event)
        self._announced += events

    def record(self, controller: JobController, observation: Observation | None) -> None:
        self.announce(controller)  # what the acts added
        events, self._announced = self._announced, []
        if self._live is not None:
            self._live.update(controller, events, time.time())
        samples = []
        if self.observer is not None:
            reports = observation.reports if observation is not None else None
            samples = self.observer.turn(time.time(), controller, events, reports)
        with self.store.batch():
            self.store.add_events(self.job_id, events)
            self.store.add_samples(self.job_id, [s.row() for s in samples])
            self._record_attempts(controller)
            if observation is not None:
                self._record_nodes(controller, observation.reports)
            self._record_job(controller)

    def _record_attempts(self, controller: JobController) -> None:
        for a in controller.attempts:
            endpoint = a.endpoint
            row = (
                a.phase.value,
                a.started_at,
                endpoint.addr if endpoint else None,
                endpoint.port if endpoint else None,
                a.reason,
                a.ended_at,
            )
            if self._changed(f"attempt/{a.number}", row):
                self.store.upsert_attempt(self.job_id, a.number, *row)

    def _record_nodes(self, controller: JobController, reports: Mapping[str, NodeReport]) -> None:
        attempt = controller.current
        assignments = {a.node_id: a for a in attempt.assignments} if attempt else {}
        rows = []
        rule = controller.config.contact_rule
        for node_id, report in reports.items():
            status = report.status
            shown = shown_state(report, rule)  # the controller's word, not just a gone process
            state = "unreachable" if shown is Contact.LOST else shown.value
            a = assignments.get(node_id)
            node = self.nodes.get(node_id)
            running = tuple(
                (w.rank, w.pid)
                for w in (status.workers if status else ())
                if w.pid is not None and w.state is WorkerState.RUNNING
            )
            # Another host's pids mean nothing here (nor may `delete` signal them): shown
            # with their host (workers), never recorded as this machine's (worker_pids).
            local = node is None or node.pid is not None
            pids = tuple(pid for _, pid in running) if local else ()
            agent_pid = node.pid if node else None
            starts = self._starts(node_id, (agent_pid, *pids))
            row = NodeRow(
                node_id,
                state,
                node_rank=a.node_rank if a else None,
                ranks=tuple(a.global_ranks) if a else (),
                attempt=status.attempt if status else None,
                agent_pid=agent_pid,
                agent_url=self.book.url(node_id),
                worker_pids=pids,
                agent_started=starts[0],
                worker_starts=starts[1:],
                host=node.hostname if node else None,
                workers=running,
            )
            if pids and node is not None:
                node.last_pids = pids
            if self._changed(f"node/{node_id}", row):
                rows.append(row)
        self.store.upsert_nodes(self.job_id, rows)

    def _starts(self, node_id: str, pids: Sequence[int | None]) -> tuple[str | None, ...]:
        """The start times of ``pids`` (procs.start_time), read from /proc when a pid is
        first seen on the node, so that `delete` signals none of them once reused."""
        pids = tuple(pids)
        before, starts = self._pid_starts.get(node_id, ((), ()))
        if pids != before:
            known = dict(zip(before, starts, strict=True))
            starts = tuple(
                (known[pid] if pid in known else start_time(pid)) if pid else None for pid in pids
            )
            self._pid_starts[node_id] = (pids, starts)
        return starts

    def _record_job(self, controller: JobController) -> None:
        progress = (controller.phase.value, controller.restarts)
        if self._changed("progress", progress):
            for tell in self.progress_listeners:
                tell(*progress)
        faults = controller.timeline.to_json()
        fields: dict[str, object] = {
            "phase": controller.phase.value,
            "reason": controller.reason,
            "restarts": controller.restarts,
            "faults": faults,
        }
        if controller.started_at is not None:
            fields["started_at"] = controller.started_at
        if controller.finished_at is not None:
            fields["finished_at"] = controller.finished_at
        if self._changed("job", json.dumps(fields, sort_keys=True, default=str)):
            self.store.update_job(self.job_id, **fields)

    def _changed(self, key: str, row: object) -> bool:
        if self._written.get(key) == row:
            return False
        self._written[key] = row
        return True
