"""The local platform: the controller in this process, one agent subprocess per node.

It observes (agent status over HTTP, agent processes), lets the controller
decide, and acts (start, stop, shut down agents). Job state goes to the
SQLite store so other ``trainguard`` commands can see it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from trainguard.agent.client import AgentClient, AgentError
from trainguard.agent.status import AgentStatus
from trainguard.control.assignment import Endpoint
from trainguard.control.controller import (
    Action,
    ControlConfig,
    Finish,
    JobController,
    JobPhase,
    StartNodes,
    StopNodes,
)
from trainguard.control.events import Event
from trainguard.control.reports import NodeReport, NodeState, WorkerFailure
from trainguard.platform.procs import kill_group
from trainguard.platform.store import Store
from trainguard.spec.plan import JobPlan, NodeGroupPlan

# Consecutive failed status polls before a live agent process counts as unreachable.
UNREACHABLE_AFTER_POLLS = 3
# Time an agent gets to exit after /shutdown before it is killed.
AGENT_SHUTDOWN_SECONDS = 15.0
EXIT_INTERRUPTED = 130

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


class LocalNode:
    """One simulated node: an agent subprocess and a client for its API."""

    def __init__(
        self, node_id: str, group: NodeGroupPlan, job_dir: Path, token: str, env: dict[str, str]
    ) -> None:
        self.node_id = node_id
        self.group = group
        self.job_dir = job_dir
        self.token = token
        self.env = env
        self.port_file = job_dir / "agents" / f"{node_id}.port"
        self.process: subprocess.Popen[bytes] | None = None
        self.client: AgentClient | None = None
        self.failed_polls = 0
        self.broken = False
        self.last_pids: tuple[int, ...] = ()

    def spawn(self, token_file: Path, logs_dir: Path) -> None:
        agents_dir = self.job_dir / "agents"
        agents_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "trainguard.agent",
            "--node-id",
            self.node_id,
            "--token-file",
            str(token_file),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            "--log-dir",
            str(logs_dir),
            "--parent-pid",
            str(os.getpid()),
            "--cwd",
            self.group.working_dir or os.getcwd(),
        ]
        for key, value in {**self.group.env, **self.env}.items():
            argv += ["--env", f"{key}={value}"]
        argv += ["--", *self.group.command]
        with open(agents_dir / f"{self.node_id}.log", "ab") as agent_log:
            self.process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=agent_log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the controller, which stops the agents
            )

    def wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"agent of {self.node_id} exited with code {self.process.returncode}; "
                    f"see {self.job_dir / 'agents' / (self.node_id + '.log')}"
                )
            if self.port_file.exists():
                port = int(self.port_file.read_text().strip())
                self.client = AgentClient(f"http://127.0.0.1:{port}", self.token)
                return
            time.sleep(0.05)
        raise RuntimeError(f"agent of {self.node_id} did not come up in time")

    @property
    def url(self) -> str:
        return self.client.base_url if self.client else ""

    def report(self) -> NodeReport:
        if self.broken or self.client is None or self.process is None:
            return NodeReport(self.node_id, reachable=False)
        if self.process.poll() is not None:
            return NodeReport(self.node_id, reachable=False, reason="agent process exited")
        try:
            status = self.client.status()
        except AgentError as err:
            self.failed_polls += 1
            if self.failed_polls >= UNREACHABLE_AFTER_POLLS:
                return NodeReport(self.node_id, reachable=False, reason=str(err))
            return NodeReport(self.node_id, reachable=True, state=NodeState.STARTING)
        self.failed_polls = 0
        return _report_from_status(status)

    def shutdown(self) -> None:
        """Ask the agent to exit; kill it and its workers if it does not."""
        if self.process is None:
            return
        if self.process.poll() is None and self.client is not None:
            try:
                self.client.shutdown()
                self.process.wait(AGENT_SHUTDOWN_SECONDS)
            except (AgentError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            kill_group(self.process.pid)
            self.process.wait()
        # Workers die with their agent (PDEATHSIG); this covers an agent that was SIGKILLed
        # before it could arm that for a worker.
        for pid in self.last_pids:
            kill_group(pid)


def _report_from_status(status: AgentStatus) -> NodeReport:
    try:
        state = NodeState(status.state)
    except ValueError:
        state = NodeState.STARTING
    failures = tuple(
        WorkerFailure(w.rank, w.local_rank, w.exitcode, w.signal, w.error)
        for w in status.workers
        if w.state == "failed"
    )
    pids = tuple(w.pid for w in status.workers if w.pid is not None)
    return NodeReport(status.node_id, True, state, status.attempt, status.reason, failures, pids)


class LocalRunner:
    """Runs one job on this machine until it ends; see the module docstring."""

    def __init__(
        self,
        plan: JobPlan,
        store: Store,
        source: str,
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
        self._interrupts = 0
        self._out_lock = threading.Lock()
        self._console_log: TextIO | None = None
        self.nodes: list[LocalNode] = []

    # -- public --------------------------------------------------------------

    @property
    def interrupted(self) -> bool:
        """True when Ctrl-C (or SIGTERM) ended the job."""
        return self._interrupts > 0

    def run(self) -> JobResult:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        token_file = self.job_dir / "token"
        token_file.touch(mode=0o600)
        token_file.write_text(token)
        self.store.create_job(
            self.job_id,
            self.plan.name,
            self.source,
            self.job_dir,
            self.plan.nnodes,
            self.plan.nproc_per_node,
            self.plan.job.model_dump(mode="json", by_alias=True),
        )
        self.nodes = self._make_nodes(token)
        controller = JobController(self._control_config(), self._endpoint)
        previous = self._install_signal_handlers()
        with open(self.logs_dir / "console.log", "a", encoding="utf-8") as console_log:
            self._console_log = console_log
            try:
                return self._run(controller, token_file)
            finally:
                for node in self.nodes:
                    node.shutdown()
                with self._out_lock:
                    self._console_log = None
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    # -- internals -----------------------------------------------------------

    def _make_nodes(self, token: str) -> list[LocalNode]:
        env = {"TRAINGUARD_JOB_DIR": str(self.job_dir)}
        nodes: list[LocalNode] = []
        for group in self.plan.groups:
            for _ in range(group.replicas):
                nodes.append(LocalNode(f"node-{len(nodes)}", group, self.job_dir, token, env))
        return nodes

    def _control_config(self) -> ControlConfig:
        return ControlConfig(
            job_id=self.job_id,
            node_ids=tuple(n.node_id for n in self.nodes),
            nproc_per_node=self.plan.nproc_per_node,
            max_restarts=self.plan.max_restarts,
            stop_grace_seconds=self.plan.stop_grace_seconds,
            active_deadline_seconds=self.plan.active_deadline_seconds,
        )

    @staticmethod
    def _endpoint(attempt: int) -> Endpoint:
        # A fresh port per attempt: rank 0 hosts a fresh store, so no stale peer addresses.
        return Endpoint("127.0.0.1", free_port())

    def _run(self, controller: JobController, token_file: Path) -> JobResult:
        self._say(
            f"job {self.job_id}: {self.plan.nnodes} nodes x {self.plan.nproc_per_node} "
            f"processes; state in {self.job_dir}"
        )
        try:
            self._start_agents(token_file)
        except RuntimeError as exc:
            controller.cancel(time.time(), f"could not start node agents: {exc}", JobPhase.FAILED)
            self._persist(controller)
            return self._result(controller)
        self.store.update_job(self.job_id, phase="Running", started_at=time.time())
        self._act(controller.start(time.time()))
        self._persist(controller)
        while not controller.phase.terminal:
            time.sleep(self.plan.poll_interval_seconds)
            now = time.time()
            actions: list[Action] = []
            if self._interrupts:
                actions += controller.cancel(now, "interrupted (Ctrl-C)")
            if self.store.job(self.job_id).desired == "delete":
                actions += controller.cancel(now, "deleted by user")
            reports = {node.node_id: node.report() for node in self.nodes}
            for node in self.nodes:
                node.last_pids = reports[node.node_id].pids or node.last_pids
            actions += controller.observe(now, reports)
            self._act(actions)
            self._persist(controller, reports)
        return self._result(controller)

    def _start_agents(self, token_file: Path) -> None:
        for node in self.nodes:
            node.spawn(token_file, self.logs_dir)
            assert node.process is not None and node.process.stdout is not None
            threading.Thread(
                target=self._pump,
                args=(node.process.stdout,),
                daemon=True,
                name=f"console-{node.node_id}",
            ).start()
        deadline = time.monotonic() + self.plan.node_start_timeout_seconds
        for node in self.nodes:
            node.wait_ready(deadline)
            self.store.upsert_node(
                self.job_id,
                node.node_id,
                "ready",
                agent_pid=node.process.pid if node.process else None,
                agent_url=node.url,
            )

    def _act(self, actions: Sequence[Action]) -> None:
        by_id = {node.node_id: node for node in self.nodes}
        for action in actions:
            if isinstance(action, StartNodes):
                for assignment in action.assignments:
                    node = by_id[assignment.node_id]
                    with self._calling(node) as client:
                        client.start(assignment)
                    self.store.upsert_node(
                        self.job_id,
                        node.node_id,
                        "starting",
                        node_rank=assignment.node_rank,
                        ranks=assignment.global_ranks,
                        attempt=assignment.attempt,
                    )
            elif isinstance(action, StopNodes):
                for node_id in action.node_ids:
                    with self._calling(by_id[node_id]) as client:
                        client.stop(action.attempt, mode=action.mode, timeout=action.timeout)
            elif isinstance(action, Finish):
                pass  # the loop ends on the controller's terminal phase

    @contextlib.contextmanager
    def _calling(self, node: LocalNode) -> Iterator[AgentClient]:
        """Call a node's agent; a refusal or no answer marks the node broken (lost)."""
        if node.client is None:
            raise RuntimeError(f"{node.node_id} has no agent to call")
        try:
            yield node.client
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

    def _pump(self, stream: object) -> None:
        """Copy an agent's console (every rank's lines, prefixed) to ours and to console.log."""
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
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
