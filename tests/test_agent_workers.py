"""The agent runs, watches and stops real worker processes (light fake workers, no torch)."""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_harness import (
    TORCHRUN_KEYS,
    AgentProcess,
    fake_worker_argv,
    make_assignment,
    pid_gone,
    spawn_agent,
    start,
    stop,
    wait_for_text,
    wait_pids_gone,
    worker_pids,
)
from conftest import wait_for
from trainguard.agent.client import AgentError
from trainguard.agent.logs import LogLayout
from trainguard.wire.status import WorkerStatus

_attempts = itertools.count()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    workdir = tmp_path_factory.mktemp("agent-workers")
    (workdir / "cwd").mkdir()
    extra = ["--cwd", str(workdir / "cwd"), "--env", f"TRAINGUARD_JOB_DIR={workdir}"]
    extra += ["--env", "FROM_AGENT=yes"]
    printed = (*TORCHRUN_KEYS, "TRAINGUARD_JOB_DIR", "FROM_AGENT", "TRAINGUARD_ATTEMPT")
    proc = spawn_agent(workdir, fake_worker_argv(printed), extra_args=extra)
    yield proc
    proc.close()


@pytest.fixture
def attempt(agent: AgentProcess) -> Iterator[int]:
    """A fresh attempt number; whatever the test left running is killed afterwards."""
    yield next(_attempts)
    agent.client.stop(stop(None, mode="process"))
    agent.wait_state("stopped")


LAST_LINE = "last line without newline\n"  # a held partial line, flushed at exit


def layout(agent: AgentProcess) -> LogLayout:
    return LogLayout(agent.log_dir)


def test_workers_get_torchrun_env_and_their_output_is_logged(
    agent: AgentProcess, attempt: int
) -> None:
    agent.client.start(start(make_assignment(attempt=attempt)))
    status = agent.wait_state("completed", attempt=attempt)

    assert [(w.local_rank, w.rank, w.state.value, w.exitcode) for w in status.workers] == [
        (0, 0, "succeeded", 0),
        (1, 1, "succeeded", 0),
    ]
    logs = layout(agent)
    for rank in (0, 1):
        stdout = logs.stdout(attempt, rank).read_text()
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": "job-test",
            "TORCHELASTIC_ERROR_FILE": str(logs.error_file(attempt, rank)),
            "OMP_NUM_THREADS": "1",  # two workers on the node, and nobody set it
            "TRAINGUARD_JOB_DIR": str(agent.log_dir.parent),  # from the agent's --env
            "FROM_AGENT": "yes",
            "TRAINGUARD_ATTEMPT": str(attempt),
        }
        for key, value in expected.items():
            assert f"env {key}={value}\n" in stdout
        assert f"cwd {agent.log_dir.parent / 'cwd'}\n" in stdout
        assert stdout.endswith("last line without newline")
        assert logs.stderr(attempt, rank).read_text() == f"stderr of rank {rank}\n"

        # The node reads completed once its workers exited; its log tailer may still be
        # draining their last lines into the combined log.
        header = f"=== trainguard: attempt {attempt} ===\n"
        path = logs.combined(rank)
        wait_for(lambda p=path, h=header: LAST_LINE in p.read_text().split(h)[-1])
        section = path.read_text().split(header, 1)[1]
        assert f"env RANK={rank}\n" in section
        assert f"stderr of rank {rank}\n" in section
        assert "last line without newline\n" in section  # a held partial line, flushed at exit

    console = agent.console()
    for rank in (0, 1):
        assert f"[rank{rank}]: env RANK={rank}\n" in console
        assert f"[rank{rank}]: stderr of rank {rank}\n" in console
        assert f"[rank{rank}]: last line without newline\n" in console


def test_one_worker_per_node_gets_no_omp_default(agent: AgentProcess, attempt: int) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, nproc_per_node=1)))
    agent.wait_state("completed", attempt=attempt)
    stdout = layout(agent).stdout(attempt, 0).read_text()
    assert "env WORLD_SIZE=1\n" in stdout
    assert "env OMP_NUM_THREADS=<unset>\n" in stdout  # torchrun sets it only for nproc > 1


def test_nonzero_exit_is_reported_at_once_and_peers_run_until_the_stop(
    agent: AgentProcess, attempt: int
) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, actions="0=sleep,1=exit3")))
    status = agent.wait_state("faulted", attempt=attempt)

    assert status.reason == "rank 1 exited with exit code 3"
    by_rank = {w.rank: w for w in status.workers}
    assert (by_rank[1].state.value, by_rank[1].exitcode, by_rank[1].signal) == ("failed", 3, None)
    # Report first: the peer runs on; whether it stops or rejoins is the controller's call.
    assert by_rank[0].state.value == "running" and not pid_gone(by_rank[0].pid or 0)
    with pytest.raises(AgentError) as refused:  # workers still run: stop first
        agent.client.start(start(make_assignment(attempt=attempt + 1000)))
    assert refused.value.status == 409
    agent.client.stop(stop(attempt, mode="process"))
    status = agent.wait_state("stopped", attempt=attempt)
    by_rank = {w.rank: w for w in status.workers}
    assert (by_rank[0].state.value, by_rank[0].signal) == ("stopped", "SIGKILL")
    assert by_rank[1].state.value == "failed"
    assert wait_pids_gone(worker_pids(status)) == []


def test_sigkilled_worker_faults_with_the_signal(agent: AgentProcess, attempt: int) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, actions="*=sleep")))
    status = agent.wait_state("running", attempt=attempt)
    wait_for_text(layout(agent).stdout(attempt, 1), "sleeping")
    os.kill(status.workers[1].pid or 0, signal.SIGKILL)

    status = agent.wait_state("faulted", attempt=attempt)
    assert status.reason == "rank 1 exited with signal SIGKILL"
    assert (status.workers[1].state.value, status.workers[1].exitcode) == ("failed", -9)
    assert status.workers[1].signal == "SIGKILL"
    assert status.workers[0].state.value == "running"


def test_error_file_message_is_reported(agent: AgentProcess, attempt: int) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, actions="0=error,1=sleep")))
    status = agent.wait_state("faulted", attempt=attempt)
    assert status.workers[0].error == "RuntimeError: boom"
    assert status.reason == "rank 0 exited with exit code 1: RuntimeError: boom"


def test_an_uncaught_exception_is_the_reason_without_an_error_file(
    agent: AgentProcess, attempt: int
) -> None:
    """No @record, so no error file: the traceback's last line on stderr is the error
    (friction: 'rank 1 exited with exit code 1', and the evidence had 'error': None)."""
    agent.client.start(start(make_assignment(attempt=attempt, actions="0=sleep,1=raise")))
    status = agent.wait_state("faulted", attempt=attempt)
    assert status.workers[1].error == "ValueError: lr must be positive"
    assert status.reason == "rank 1 exited with exit code 1: ValueError: lr must be positive"


@pytest.mark.parametrize("mode", ["graceful", "process"])
def test_stop_kills_workers_then_next_attempt_starts(
    agent: AgentProcess, attempt: int, mode: str
) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, actions="*=sleep")))
    status = agent.wait_state("running", attempt=attempt)
    pids = worker_pids(status)
    wait_for_text(layout(agent).stdout(attempt, 0), "sleeping")

    with pytest.raises(AgentError) as refused:
        agent.client.start(start(make_assignment(attempt=attempt + 1000)))
    assert refused.value.status == 409

    agent.client.stop(stop(attempt, mode=mode, timeout=10))
    status = agent.wait_state("stopped", attempt=attempt)
    expected_signal = "SIGTERM" if mode == "graceful" else "SIGKILL"
    assert [(w.state.value, w.signal) for w in status.workers] == [("stopped", expected_signal)] * 2
    assert wait_pids_gone(pids) == []

    agent.client.start(start(make_assignment(attempt=attempt + 1000)))
    status = agent.wait_state("completed", attempt=attempt + 1000)
    assert all(w.exitcode == 0 for w in status.workers)


def test_graceful_stop_escalates_to_sigkill(agent: AgentProcess, attempt: int) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, actions="*=ignore-term")))
    agent.wait_state("running", attempt=attempt)
    for rank in (0, 1):  # both now ignore SIGTERM
        wait_for_text(layout(agent).stdout(attempt, rank), "sleeping")
    agent.client.stop(stop(attempt, mode="graceful", timeout=0.5))
    status = agent.wait_state("stopped", attempt=attempt)
    assert [w.signal for w in status.workers] == ["SIGKILL", "SIGKILL"]


def test_graceful_stop_continues_a_stopped_worker_first(agent: AgentProcess, attempt: int) -> None:
    agent.client.start(start(make_assignment(attempt=attempt, actions="*=handle-term")))
    status = agent.wait_state("running", attempt=attempt)
    for rank in (0, 1):
        wait_for_text(layout(agent).stdout(attempt, rank), "sleeping")
    stopped_pid = worker_pids(status)[1]
    os.kill(stopped_pid, signal.SIGSTOP)  # a hung worker
    agent.client.stop(stop(attempt, mode="graceful", timeout=30))
    status = agent.wait_state("stopped", attempt=attempt)
    # Its SIGTERM handler ran (it was continued), instead of a SIGKILL after the grace.
    assert "got SIGTERM" in wait_for_text(layout(agent).stdout(attempt, 1), "got SIGTERM")
    assert [w.signal for w in status.workers] == [None, None]


def test_stop_of_another_attempt_leaves_the_current_one(agent: AgentProcess, attempt: int) -> None:
    agent.client.stop(stop(None))  # nothing runs: fine
    agent.wait_state("stopped")
    agent.client.start(start(make_assignment(attempt=attempt, actions="*=sleep")))
    status = agent.wait_state("running", attempt=attempt)
    agent.client.stop(stop(attempt + 1000, mode="process"))
    agent.client.stop(stop(attempt + 2000, mode="process"))

    def unchanged(workers: tuple[WorkerStatus, ...]) -> list[WorkerStatus]:
        return [w.model_copy(update={"cpu_seconds": None}) for w in workers]  # it runs on

    assert unchanged(agent.wait_state("running", attempt=attempt).workers) == unchanged(
        status.workers
    )
    assert not any(pid_gone(pid) for pid in worker_pids(status))


@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")
def test_worker_envs_follow_torchrun_rules() -> None:
    from trainguard.agent.workers import reserved_env_keys, worker_envs

    two = make_assignment(nproc_per_node=2)
    envs = worker_envs(two, {"TRAINGUARD_JOB_DIR": "/jobs/x"}, inherited={})
    assert envs[1]["RANK"] == "1" and envs[1]["OMP_NUM_THREADS"] == "1"
    assert envs[0]["TRAINGUARD_JOB_DIR"] == "/jobs/x"
    assert "OMP_NUM_THREADS" not in worker_envs(two, {}, inherited={"OMP_NUM_THREADS": "4"})[0]
    assert worker_envs(two, {"OMP_NUM_THREADS": "8"}, inherited={})[0]["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in worker_envs(make_assignment(nproc_per_node=1), {}, {})[0]
    assert {"RANK", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"} <= reserved_env_keys()
    # torchrun's other two: NCCL's async error handling unless set, and no agent store.
    assert envs[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert envs[0]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert worker_envs(two, {}, inherited=mine)[0].get("TORCH_NCCL_ASYNC_ERROR_HANDLING") is None
    assert worker_envs(two, mine, inherited={})[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")
def test_workers_of_nodes_sharing_a_host_count_together_for_omp() -> None:
    """2 simulated nodes x 1 process: the platform says 2 workers share the host, so each
    gets OMP_NUM_THREADS=1 (torchrun's rule counts one node's; friction: a thread per core
    in every worker, 4x slower)."""
    from trainguard.agent.workers import HOST_WORKERS_ENV, worker_envs

    one = make_assignment(nproc_per_node=1)
    env = worker_envs(one, {HOST_WORKERS_ENV: "2"}, inherited={})[0]
    assert env["OMP_NUM_THREADS"] == "1"
    assert HOST_WORKERS_ENV not in env  # the agent's input, not the worker's
    assert "OMP_NUM_THREADS" not in worker_envs(one, {HOST_WORKERS_ENV: "1"}, inherited={})[0]
    assert "OMP_NUM_THREADS" not in worker_envs(one, {HOST_WORKERS_ENV: "x"}, inherited={})[0]
    set_ = worker_envs(one, {HOST_WORKERS_ENV: "2"}, inherited={"OMP_NUM_THREADS": "4"})[0]
    assert "OMP_NUM_THREADS" not in set_  # inherited from the agent: the worker has it


def test_last_exception_reads_the_last_traceback_through_rank_prefixes(tmp_path: Path) -> None:
    from trainguard.agent.workers import last_exception, last_traceback, tail_lines

    chained = [
        "warming up",
        "Traceback (most recent call last):",
        '  File "t.py", line 3, in <module>',
        "KeyError: 'a'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "t.py", line 5, in <module>',
        "[rank1]:     raise ValueError('bad lr')",
        "[rank1]:     ^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "[rank1]: ValueError: bad lr",
        "[rank1]: second line of the message",
        "some atexit output",
    ]
    assert last_exception(chained) == "ValueError: bad lr"
    assert last_exception(["exit 3 without a traceback"]) is None
    assert last_exception(["Traceback (most recent call last):", '  File "t.py"']) is None
    # A stream file whose read part the tailer gave back (a hole: zeros) keeps its end.
    spool = tmp_path / "stderr.log"
    spool.write_bytes(b"\0" * 5000 + b"\n".join(line.encode() for line in chained) + b"\n")
    assert last_exception(tail_lines(spool)) == "ValueError: bad lr"
    assert last_traceback(chained) == "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "t.py", line 5, in <module>',
            "    raise ValueError('bad lr')",
            "    ^^^^^^^^^^^^^^^^^^^^^^^^^^",
            "ValueError: bad lr",
        ]
    )
    assert last_traceback(["exit 3 without a traceback"]) is None
    assert tail_lines(spool, size=30) == ["some atexit output"]  # a cut first line dropped
    assert tail_lines(tmp_path / "absent.log") == []
