"""The local platform: the controller in this process, one agent subprocess per node.

It observes (agent status over HTTP, agent processes), lets the controller
decide, and acts (start, stop, shut down agents). Job state goes to the
SQLite store so other ``trainguard`` commands can see it.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import IO, Any, TextIO

from trainguard.agent.client import AgentClient, AgentError
from trainguard.control.assignment import Endpoint
from trainguard.control.controller import (
    Action,
    ControlConfig,
    Finish,
    JobController,
    JobPhase,
    PersistCheckpoint,
    RejoinNodes,
    StartNodes,
    StopNodes,
)
from trainguard.control.events import Event
from trainguard.control.reports import NodeReport
from trainguard.platform.config import control_config
from trainguard.platform.inject import Injection, Injector, Targets
from trainguard.platform.node import LocalNode
from trainguard.platform.store import Store
from trainguard.spec.plan import JobPlan, NodeGroupPlan

EXIT_INTERRUPTED = 130
# Where the local platform keeps each node's memory checkpoint tier.
MEMORY_ROOT = Path("/dev/shm/trainguard")

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass(frozen=True)
class JobResult:
    job_id: str
    phase: JobPhase
    reason: str
    job_dir: Path

    @property
    def exit_code(self) -> int:
        return 0 if self.phase is JobPhase.SUCCEEDED else 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def new_job_id(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


class LocalRunner:
    """Runs one job on this machine until it ends; see the module docstring."""

    def __init__(
        self,
        plan: JobPlan,
        store: Store,
        source: str,
        injections: Sequence[Injection] = (),
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        self.plan = plan
        self.store = store
        self.source = source
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.job_id = new_job_id(plan.name)
        self.job_dir = store.root / "jobs" / self.job_id
        self.logs_dir = self.job_dir / "logs"
        self.token_file = self.job_dir / "token"
        # Each node's memory tier: RAM that outlives its workers; removed when the job ends.
        self.memory_root = MEMORY_ROOT / self.job_id
        # Raises ValueError naming the SPEC when a target is out of range.
        self.injector = Injector(injections, plan.world_size, plan.nnodes)
        self._interrupts = 0
        self._out_lock = threading.Lock()
        self._console_log: TextIO | None = None
        self._token = ""
        self._groups: dict[str, NodeGroupPlan] = {}
        self.nodes: dict[str, LocalNode] = {}  # the live node of each node id
        self._first_step_at: float | None = None

    # -- public --------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        """True when Ctrl-C (or SIGTERM) ended the job."""
        return self._interrupts > 0

    def run(self) -> JobResult:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._token = secrets.token_urlsafe(32)
        self.token_file.touch(mode=0o600)
        self.token_file.write_text(self._token)
        self.store.create_job(
            self.job_id,
            self.plan.name,
            self.source,
            self.job_dir,
            self.plan.nnodes,
            self.plan.nproc_per_node,
            self.plan.job.model_dump(mode="json", by_alias=True),
        )
        controller = JobController(self._control_config(), self._endpoint)
        previous = self._install_signal_handlers()
        with open(self.logs_dir / "console.log", "a", encoding="utf-8") as console_log:
            self._console_log = console_log
            try:
                return self._run(controller)
            finally:
                self.injector.close()  # resume stopped workers so they can be shut down
                for node in self.nodes.values():
                    node.shutdown()
                shutil.rmtree(self.memory_root, ignore_errors=True)
                with self._out_lock:
                    self._console_log = None
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    # -- internals -----------------------------------------------------------

    def _control_config(self) -> ControlConfig:
        # The local platform always has a durable tier (default: <job dir>/durable).
        config, groups = control_config(self.plan, self.job_id, durable=True)
        self._groups = {node_id: group for node_id, (_, group) in groups.items()}
        return config

    @staticmethod
    def _endpoint(attempt: int) -> Endpoint:
        # A fresh port per attempt: rank 0 hosts a fresh store, so no stale peer addresses.
        return Endpoint("127.0.0.1", free_port())

    def _run(self, controller: JobController) -> JobResult:
        self._say(
            f"job {self.job_id}: {self.plan.nnodes} nodes x {self.plan.nproc_per_node} "
            f"processes; state in {self.job_dir}"
        )
        try:
            self._bring_up(controller.nodes)
        except RuntimeError as exc:
            controller.cancel(time.time(), f"could not start node agents: {exc}", JobPhase.FAILED)
            self._persist(controller)
            return self._result(controller)
        self.store.update_job(self.job_id, phase="Running", started_at=time.time())
        self._act(controller, controller.start(time.time()))
        self._persist(controller)
        while not controller.phase.terminal:
            time.sleep(self.plan.poll_interval_seconds)
            now = time.time()
            actions: list[Action] = []
            if self._interrupts:
                actions += controller.cancel(now, "interrupted (Ctrl-C)")
            if self.store.job(self.job_id).desired == "delete":
                actions += controller.cancel(now, "deleted by user")
            reports = {node_id: node.report() for node_id, node in self.nodes.items()}
            actions += controller.observe(now, reports)
            self._inject(controller, now, reports)
            self._act(controller, actions)
            self._persist(controller, reports)
        return self._result(controller)

    def _bring_up(self, node_ids: Sequence[str]) -> None:
        """Start a fresh agent for each node id (replacing a live one) and wait until all answer."""
        fresh = []
        for node_id in node_ids:
            old = self.nodes.pop(node_id, None)
            if old is not None:
                old.shutdown()
            # <node>/memory: the node's own tier; <node>/replicas: its copies of its peers'.
            memory_dir = self.memory_root / node_id / "memory"
            memory_dir.mkdir(parents=True, exist_ok=True)
            checkpointing = self.plan.job.spec.checkpointing
            env = {
                "TRAINGUARD_JOB_DIR": str(self.job_dir),
                "TRAINGUARD_CHECKPOINT_MEMORY_DIR": str(memory_dir),
                "TRAINGUARD_CHECKPOINT_CONFIG": json.dumps(
                    checkpointing.env_json(str(self.job_dir / "durable"))
                ),
            }
            node = LocalNode(node_id, self._groups[node_id], self.job_dir, self._token, env)
            node.spawn(self.token_file, self.logs_dir)
            assert node.process is not None and node.process.stdout is not None
            threading.Thread(
                target=self._pump,
                args=(node.process.stdout,),
                daemon=True,
                name=f"console-{node_id}",
            ).start()
            self.nodes[node_id] = node
            fresh.append(node)
        deadline = time.monotonic() + self.plan.node_start_timeout_seconds
        for node in fresh:
            node.wait_ready(deadline)
            self.store.upsert_node(
                self.job_id,
                node.node_id,
                "ready",
                agent_pid=node.process.pid if node.process else None,
                agent_url=node.url,
            )

    def _act(self, controller: JobController, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, StartNodes):
                self._start(action)
            elif isinstance(action, RejoinNodes):
                peers = {n: node.url for n, node in self.nodes.items()}
                for assignment in action.assignments:
                    rejoin = partial(
                        AgentClient.rejoin, assignment=replace(assignment, peers=peers)
                    )
                    self._call(self.nodes.get(assignment.node_id), rejoin)
                    self.store.upsert_node(
                        self.job_id, assignment.node_id, "running", attempt=assignment.attempt
                    )
            elif isinstance(action, StopNodes):
                stop = partial(
                    AgentClient.stop,
                    attempt=action.attempt,
                    mode=action.mode,
                    timeout=action.timeout,
                    capture_stacks=action.capture_stacks,
                )
                for node_id in action.node_ids:
                    self._call(self.nodes.get(node_id), stop)
            elif isinstance(action, PersistCheckpoint):
                persist = partial(
                    AgentClient.persist, step=action.step, world_size=action.world_size
                )
                for node_id in action.node_ids:
                    node = self.nodes.get(node_id)
                    if node is None or node.client is None:
                        continue
                    try:  # a failed persist is the controller's to notice, not a lost node
                        persist(node.client, commit=node_id == action.commit_node)
                    except AgentError as err:
                        self._say(f"{node_id}: could not persist step {action.step}: {err}")
            elif isinstance(action, Finish):
                pass  # the loop ends on the controller's terminal phase

    def _start(self, action: StartNodes) -> None:
        wanted = [a.node_id for a in action.assignments]
        for node_id in [n for n in self.nodes if n not in wanted]:
            self.nodes.pop(node_id).shutdown()  # replaced: a spare took its place
        if action.scope == "job" or any(n not in self.nodes for n in wanted):
            stale = wanted if action.scope == "job" else [n for n in wanted if n not in self.nodes]
            try:
                self._bring_up(stale)
            except RuntimeError as exc:
                # The next poll reports the node unreachable; the controller decides.
                self._say(f"could not bring up nodes {stale}: {exc}")
        peers = {n: self.nodes[n].url for n in wanted if n in self.nodes}
        for assignment in action.assignments:
            self._call(
                self.nodes.get(assignment.node_id),
                partial(AgentClient.start, assignment=replace(assignment, peers=peers)),
            )
            self.store.upsert_node(
                self.job_id,
                assignment.node_id,
                "starting",
                node_rank=assignment.node_rank,
                ranks=assignment.global_ranks,
                attempt=assignment.attempt,
            )

    def _inject(
        self, controller: JobController, now: float, reports: dict[str, NodeReport]
    ) -> None:
        attempt = controller.current
        if not self.injector.pending or attempt is None:
            return
        progress = attempt.watch.progress
        if progress is not None and self._first_step_at is None:
            self._first_step_at = progress.first_time
        node_ranks = {a.node_id: a.node_rank for a in attempt.assignments}
        rank_pids: dict[int, int] = {}
        node_pids: dict[int, tuple[int, tuple[int, ...]]] = {}
        for node_id, report in reports.items():
            node = self.nodes[node_id]
            if report.attempt != attempt.number or node_id not in node_ranks:
                continue
            rank_pids.update(report.rank_pids)
            if node.process is not None:
                node_pids[node_ranks[node_id]] = (node.process.pid, report.pids)
        fired = self.injector.poll(
            now,
            progress.step if progress else None,
            self._first_step_at,
            Targets(rank_pids, node_pids),
        )
        by_rank = {v: k for k, v in node_ranks.items()}
        for f in fired:
            if f.injection.kind == "node-kill" and f.node is not None:
                # A lost node loses its RAM: its memory tier goes with it.
                shutil.rmtree(self.memory_root / by_rank[f.node], ignore_errors=True)
            controller.note_injection(
                now, f.injection.text, f.rank, None if f.node is None else by_rank.get(f.node)
            )

    def _call(self, node: LocalNode | None, call: Callable[[AgentClient], None]) -> None:
        """Call a node's agent; a refusal or no answer marks the node broken (lost)."""
        if node is None or node.client is None:
            if node is not None:
                node.broken = True
            return
        try:
            call(node.client)
        except AgentError as err:
            self._say(f"{node.node_id}: agent refused or unreachable: {err}")
            node.broken = True

    def _persist(
        self, controller: JobController, reports: dict[str, NodeReport] | None = None
    ) -> None:
        events = controller.drain_events()
        for event in events:
            self._say_event(event)
        self.store.add_events(self.job_id, events)
        for attempt in controller.attempts:
            self.store.upsert_attempt(
                self.job_id,
                attempt.number,
                attempt.phase.value,
                attempt.started_at,
                attempt.endpoint.addr,
                attempt.endpoint.port,
                attempt.reason,
                attempt.ended_at,
            )
        for node_id, report in (reports or {}).items():
            state = report.state.value if report.reachable else "unreachable"
            self.store.upsert_node(self.job_id, node_id, state, worker_pids=report.pids)
        fields: dict[str, object] = {
            "phase": controller.phase.value,
            "reason": controller.reason,
            "restarts": controller.restarts,
            "faults": controller.timeline.to_json(),
        }
        if controller.phase.terminal:
            fields["finished_at"] = time.time()
        self.store.update_job(self.job_id, **fields)

    def _result(self, controller: JobController) -> JobResult:
        reason = controller.reason or ""
        self._say(f"job {self.job_id} {controller.phase.value.lower()}: {reason}")
        self._say(f"logs:  {self.logs_dir}  (trainguard logs {self.job_id} [--rank R])")
        self._say(f"state: {self.store.root}  (trainguard describe {self.job_id})")
        return JobResult(self.job_id, controller.phase, reason, self.job_dir)

    def _pump(self, stream: IO[bytes]) -> None:
        """Copy an agent's console (every rank's lines, prefixed) to ours and to console.log."""
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            with self._out_lock:
                self.out.write(line)
                self.out.flush()
                if self._console_log is not None:
                    self._console_log.write(line)
                    self._console_log.flush()

    def _say(self, message: str) -> None:
        with self._out_lock:
            self.err.write(f"[trainguard] {message}\n")
            self.err.flush()

    def _say_event(self, event: Event) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
        self._say(f"{stamp} {event.kind}: {event.message}")

    def _install_signal_handlers(self) -> dict[signal.Signals, SignalHandler]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt  # second Ctrl-C: stop waiting; cleanup still runs

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
