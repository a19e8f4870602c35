"""Run real node agents in tests: spawn, wait for the port file, drive, clean up.

Reusable by any test that needs an agent subprocess (``from agent_harness import ...``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.agent.client import AgentClient, AgentError
from trainguard.wire.requests import AttemptRequest, NodeAssignment, StopRequest
from trainguard.wire.status import NodeStatus

TOKEN = "test-token-0123456789"
STARTUP_TIMEOUT = 60.0  # s; the agent imports torch (~2 s, far more on a busy machine)
STATE_TIMEOUT = 30.0

# A light worker (no torch). Prints its torchrun environment, one stderr line, then
# does what FAKE_ACTIONS says for its rank ("0=exit3,1=sleep"; "*" for any rank):
# exitN | sleep | ignore-term (sleep, ignoring SIGTERM) | handle-term (sleep; on SIGTERM print
# "got SIGTERM" and exit 0) | error (torch-style error file, exit 1) | raise (an uncaught
# ValueError, whose traceback goes to stderr as torch.distributed's excepthook prints it:
# every line prefixed with [rankN]:, exit 1).
FAKE_WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    rank = os.environ["RANK"]
    for key in sys.argv[1:]:
        print(f"env {key}={os.environ.get(key, '<unset>')}")
    print(f"cwd {os.getcwd()}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    items = [i.split("=", 1) for i in os.environ.get("FAKE_ACTIONS", "").split(",") if i]
    actions = dict(items)
    action = actions.get(rank, actions.get("*", "exit0"))
    if action in ("sleep", "ignore-term", "handle-term"):
        if action == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if action == "handle-term":
            def on_term(signum, frame):
                print("got SIGTERM", flush=True)
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_term)
        print("sleeping", flush=True)
        time.sleep(600)
    if action == "raise":
        sys.excepthook = lambda *exc: sys.stderr.write("".join(
            f"[rank{rank}]: {line}\\n"
            for line in "".join(__import__("traceback").format_exception(*exc)).splitlines()
        ))
        raise ValueError("lr must be positive")
    if action == "error":
        message = {"message": "RuntimeError: boom", "extraInfo": {"timestamp": "0"}}
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": message}, f)
        sys.exit(1)
    sys.stdout.write("last line without newline")
    sys.exit(int(action[4:]))
    """
)
TORCHRUN_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
)


def fake_worker_argv(print_env: Sequence[str] = TORCHRUN_KEYS) -> list[str]:
    return [sys.executable, "-u", "-c", FAKE_WORKER, *print_env]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_assignment(
    node_id: str = "node-0",
    *,
    attempt: int = 0,
    nproc_per_node: int = 2,
    nnodes: int = 1,
    node_rank: int = 0,
    job_id: str = "job-test",
    actions: str = "",
    master_port: int = 29500,
) -> NodeAssignment:
    """An assignment whose workers follow ``actions`` (see ``FAKE_WORKER``)."""
    return NodeAssignment(
        job_id=job_id,
        node_id=node_id,
        attempt=attempt,
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc_per_node,
        master_addr="127.0.0.1",
        master_port=master_port,
        restart_count=attempt,
        max_restarts=3,
        extra_env={"FAKE_ACTIONS": actions},
    )


def start(assignment: NodeAssignment, peers: dict[str, str] | None = None) -> AttemptRequest:
    """The ``/start`` (or ``/rejoin``) body of ``assignment``."""
    return AttemptRequest(assignment=assignment, peers=peers or {})


def stop(attempt: int | None = None, mode: str = "graceful", timeout: float = 10.0) -> StopRequest:
    return StopRequest.model_validate(
        {"attempt": attempt, "mode": mode, "timeout": timeout}, strict=False
    )


def request_json(
    url: str, method: str, body: bytes | None, token: str | None
) -> tuple[int, dict[str, Any]]:
    """One HTTP request with an optional bearer token: ``(status, JSON reply)``, errors
    included (a refusal is a reply, not an exception)."""
    request = urllib.request.Request(url, data=body, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def pid_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_pids_gone(pids: Sequence[int], timeout: float = 15.0) -> list[int]:
    """Wait until every pid is gone; returns those still running at the deadline."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if not pid_gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if not pid_gone(p)]
    return alive


def wait_for_text(path: Path, text: str, timeout: float = STATE_TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    while True:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n{content}")
        time.sleep(0.05)


def wait_for_port_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"agent exited with {proc.returncode} before writing {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no port file {path} after {timeout} s")
        time.sleep(0.05)
    return int(path.read_text())


@dataclass
class AgentProcess:
    """A running agent subprocess; its console and log go to files under ``workdir``."""

    proc: subprocess.Popen[bytes]
    node_id: str
    port: int
    token: str
    log_dir: Path
    console_path: Path
    stderr_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> AgentClient:
        return AgentClient(self.url, self.token)

    def console(self) -> str:
        return self.console_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_state(
        self, *states: str, attempt: int | None = None, timeout: float = STATE_TIMEOUT
    ) -> NodeStatus:
        """Poll ``/status`` until the state is one of ``states`` (for ``attempt``, if given)."""
        deadline = time.monotonic() + timeout
        status: NodeStatus | None = None
        while time.monotonic() < deadline:
            with contextlib.suppress(AgentError):
                status = self.client.status()
                if status.state in states and (attempt is None or status.attempt == attempt):
                    return status
            time.sleep(0.05)
        raise AssertionError(
            f"agent {self.node_id} not in {states} after {timeout} s; last: {status}\n"
            f"agent stderr:\n{self.stderr()}"
        )

    def wait_exit(self, timeout: float = STATE_TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """End the agent however it is (SIGTERM, then SIGKILL)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def agent_command(
    node_id: str,
    token_file: Path,
    log_dir: Path,
    port_file: Path,
    worker_argv: Sequence[str],
    extra_args: Sequence[str] = (),
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainguard.agent",
        "--node-id",
        node_id,
        "--token-file",
        str(token_file),
        "--log-dir",
        str(log_dir),
        "--port-file",
        str(port_file),
        *extra_args,
        "--",
        *worker_argv,
    ]


def agent_env() -> dict[str, str]:
    """The test's environment, minus what would make worker environments vary."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    return env


def spawn_agent(
    workdir: Path,
    worker_argv: Sequence[str] | None = None,
    *,
    node_id: str = "node-0",
    token: str = TOKEN,
    log_dir: Path | None = None,
    extra_args: Sequence[str] = (),
    startup_timeout: float = STARTUP_TIMEOUT,
) -> AgentProcess:
    """Start ``python -m trainguard.agent`` and wait until it serves."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / f"{node_id}.token"
    token_file.write_text(token + "\n")
    port_file = workdir / f"{node_id}.port"
    port_file.unlink(missing_ok=True)
    log_dir = log_dir or workdir / "logs"
    console_path = workdir / f"{node_id}.console"
    stderr_path = workdir / f"{node_id}.stderr"
    command = agent_command(
        node_id, token_file, log_dir, port_file, worker_argv or fake_worker_argv(), extra_args
    )
    with open(console_path, "wb") as out, open(stderr_path, "wb") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, cwd=workdir, env=agent_env())
    try:
        port = wait_for_port_file(port_file, proc, startup_timeout)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise AssertionError(f"agent did not start:\n{stderr_path.read_text()}") from None
    return AgentProcess(proc, node_id, port, token, log_dir, console_path, stderr_path)


def worker_pids(status: NodeStatus) -> list[int]:
    return [w.pid for w in status.workers if w.pid is not None]
