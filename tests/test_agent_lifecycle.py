"""The agent's own life: startup checks, shutdown, signals, and no orphaned workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent_harness import (
    AgentProcess,
    agent_command,
    agent_env,
    fake_worker_argv,
    make_assignment,
    pid_gone,
    spawn_agent,
    start,
    wait_for_port_file,
    wait_for_text,
    wait_pids_gone,
    worker_pids,
)
from trainguard.agent.logs import LogLayout


def start_sleepers(agent: AgentProcess) -> list[int]:
    """Start two sleeping workers; returns their pids once they have exec'd the command."""
    agent.client.start(start(make_assignment(actions="*=sleep")))
    status = agent.wait_state("running")
    for rank in (0, 1):
        wait_for_text(LogLayout(agent.log_dir).stdout(0, rank), "sleeping")
    pids = worker_pids(status)
    assert len(pids) == 2 and not any(pid_gone(p) for p in pids)
    return pids


def test_sigkilled_agent_takes_its_workers_with_it(tmp_path: Path) -> None:
    agent = spawn_agent(tmp_path)
    try:
        pids = start_sleepers(agent)
        agent.proc.kill()
        agent.wait_exit()
        assert wait_pids_gone(pids) == []
    finally:
        agent.close()


def test_shutdown_ends_agent_and_workers(tmp_path: Path) -> None:
    agent = spawn_agent(tmp_path)
    try:
        pids = start_sleepers(agent)
        agent.client.shutdown()
        assert agent.wait_exit() == 0
        assert wait_pids_gone(pids, timeout=1) == []  # killed before the agent exited
    finally:
        agent.close()


def test_sigterm_stops_workers_and_exits(tmp_path: Path) -> None:
    agent = spawn_agent(tmp_path)
    try:
        pids = start_sleepers(agent)
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait_exit() == 128 + signal.SIGTERM
        assert wait_pids_gone(pids, timeout=1) == []
        assert "agent received SIGTERM" in agent.stderr()
    finally:
        agent.close()


CONTROLLER = textwrap.dedent(
    """
    import os, subprocess, sys, json
    command = json.loads(sys.argv[1])
    command[command.index("--") : command.index("--")] = ["--parent-pid", str(os.getpid())]
    with open(sys.argv[2], "wb") as err:
        agent = subprocess.Popen(command, stderr=err)
    print(agent.pid, flush=True)
    agent.wait()
    """
)


def test_agent_dies_with_its_parent_and_so_do_workers(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken")
    port_file = tmp_path / "port"
    command = agent_command("node-0", token, tmp_path / "logs", port_file, fake_worker_argv())
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, json.dumps(command), str(tmp_path / "agent.err")],
        stdout=subprocess.PIPE,
        env=agent_env(),
        cwd=tmp_path,
    )
    assert controller.stdout is not None
    agent_pid = int(controller.stdout.readline())
    try:
        port = wait_for_port_file(port_file, controller, timeout=60)
        agent = AgentProcess(
            controller, "node-0", port, "t0ken", tmp_path / "logs", tmp_path, tmp_path / "agent.err"
        )
        pids = start_sleepers(agent)
        controller.kill()
        controller.wait()
        assert wait_pids_gone([agent_pid, *pids]) == []
    finally:
        if controller.poll() is None:
            controller.kill()
        if not pid_gone(agent_pid):
            os.kill(agent_pid, signal.SIGKILL)


def run_agent(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainguard.agent", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize(
    ("token_text", "message"), [(None, "does not exist"), ("  \n", "is empty")]
)
def test_refuses_to_start_without_a_token(
    tmp_path: Path, token_text: str | None, message: str
) -> None:
    token = tmp_path / "token"
    if token_text is not None:
        token.write_text(token_text)
    result = run_agent(
        tmp_path, "--node-id", "n", "--token-file", str(token), "--log-dir", "logs", "--", "true"
    )
    assert result.returncode == 2
    assert "--token-file" in result.stderr and message in result.stderr


def test_refuses_bad_command_lines(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    base = ["--node-id", "n", "--token-file", str(token), "--log-dir", "logs"]
    assert "WORKER_ARGV" in run_agent(tmp_path, *base).stderr
    assert "KEY=VALUE" in run_agent(tmp_path, *base, "--env", "NOEQUALS", "--", "true").stderr
    clash = run_agent(tmp_path, *base, "--env", "RANK=3", "--", "true")
    assert clash.returncode == 2 and "RANK" in clash.stderr
    no_dir = run_agent(tmp_path, *base, "--cwd", "missing", "--", "true")
    assert no_dir.returncode == 2 and "--cwd" in no_dir.stderr


def test_exits_at_once_if_its_parent_is_already_gone(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    not_parent = str(os.getpid() + 1_000_000)
    args = ["--node-id", "n", "--token-file", str(token), "--log-dir", "logs"]
    result = run_agent(tmp_path, *args, "--parent-pid", not_parent, "--", "true")
    assert result.returncode == 1
    assert "is gone" in result.stderr
