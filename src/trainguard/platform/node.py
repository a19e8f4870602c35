"""One simulated node of the local platform: an agent subprocess and a client for its API."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.agent.client import AgentClient, AgentError
from trainguard.agent.status import AgentStatus
from trainguard.control.reports import (
    CheckpointReport,
    NodeReport,
    NodeState,
    RankProgress,
    RuleActivity,
    WorkerFailure,
)
from trainguard.monitor.rules import Detection
from trainguard.monitor.worker_events import WorkerEvent
from trainguard.platform.procs import kill_group
from trainguard.spec.plan import NodeGroupPlan

# Consecutive failed status polls before a live agent process counts as unreachable.
UNREACHABLE_AFTER_POLLS = 3
# Time an agent gets to exit after /shutdown before it is killed.
AGENT_SHUTDOWN_SECONDS = 15.0


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
        self.port_file.unlink(missing_ok=True)  # a replaced agent's port is not ours
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
        return report_from_status(status)

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


def report_from_status(status: AgentStatus) -> NodeReport:
    """An agent's status as the controller sees it (malformed detection data is dropped)."""
    try:
        state = NodeState(status.state)
    except ValueError:
        state = NodeState.STARTING
    failures = tuple(
        WorkerFailure(w.rank, w.local_rank, w.exitcode, w.signal, w.error)
        for w in status.workers
        if w.state == "failed"
    )
    alive = [w for w in status.workers if w.pid is not None and w.state == "running"]
    monitor = status.monitor
    return NodeReport(
        status.node_id,
        True,
        state,
        status.attempt,
        status.reason,
        failures,
        pids=tuple(w.pid for w in alive if w.pid is not None),
        rank_pids={w.rank: w.pid for w in alive if w.pid is not None},
        rules={
            name: RuleActivity(_number(v.get("last_match_at")), bool(v.get("stopped")))
            for name, v in _objects(monitor.get("rules")).items()
        },
        progress={
            int(rank): p
            for rank, v in _objects(monitor.get("progress")).items()
            if rank.isdigit() and (p := _progress(v)) is not None
        },
        detections=tuple(
            d for raw in monitor.get("detections") or [] if (d := _detection(raw)) is not None
        ),
        heartbeats={
            int(rank): float(v["time"])
            for rank, v in _objects(status.heartbeats).items()
            if rank.isdigit() and _number(v.get("time")) is not None
        },
        stacks={int(rank): str(text) for rank, text in status.stacks.items() if rank.isdigit()},
        worker_events=tuple(
            e for raw in status.events if (e := WorkerEvent.from_json(raw)) is not None
        ),
        checkpoint=_checkpoint_report(status.checkpoint),
    )


def _checkpoint_report(data: dict[str, Any]) -> CheckpointReport:
    """The ``checkpoint`` part of an agent status (see ``DurablePersister.status``)."""
    memory = {
        int(step): v for step, v in _objects(data.get("memory_steps")).items() if step.isdigit()
    }
    failed = data.get("failed")
    if not isinstance(failed, dict):
        failed = {}
    return CheckpointReport(
        memory_steps={
            step: frozenset(r for r in v.get("ranks") or [] if isinstance(r, int))
            for step, v in memory.items()
        },
        forced_steps=frozenset(step for step, v in memory.items() if v.get("force") is True),
        written=_ints(data.get("written")),
        committed=_ints(data.get("committed")),
        failed={
            int(step): str(reason)
            for step, reason in failed.items()
            if isinstance(step, str) and step.isdigit()
        },
    )


def _ints(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))


def _objects(value: object) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, dict)}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _progress(v: dict[str, Any]) -> RankProgress | None:
    try:
        return RankProgress(
            int(v["first_step"]), float(v["first_time"]), int(v["step"]), float(v["time"])
        )
    except (KeyError, TypeError, ValueError):
        return None


def _detection(raw: object) -> Detection | None:
    if not isinstance(raw, dict):
        return None
    try:
        return Detection.from_json(raw)
    except (KeyError, TypeError, ValueError):
        return None
