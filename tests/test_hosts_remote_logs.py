"""``trainguard logs JOB --rank R`` on the controller's host, for a rank another host runs:
read from that host's node agent (``GET /logs``, with the job's token), on loopback.

The "other host" is a real agent process bound to 127.0.0.2 (a loopback address the
command does not take for its own host); the job's record is a store like the
controller's, naming that agent as the holder of rank 1.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_harness import TOKEN, AgentProcess, spawn_agent
from conftest import Trainguard
from trainguard.agent.rank_log import MAX_CHUNK
from trainguard.platform.store import NodeRow, Store

OTHER_HOST = "127.0.0.2"


@pytest.fixture(scope="module")
def other_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    proc = spawn_agent(
        tmp_path_factory.mktemp("other-host"), node_id="node-1", extra_args=["--host", OTHER_HOST]
    )
    yield proc
    proc.close()


def _job(tg: Trainguard, agent_url: str, name: str) -> str:
    """A running job of two nodes in the controller host's store: node-0 here, node-1
    (rank 1) on the other host at ``agent_url``."""
    job_dir = tg.state_dir / "jobs" / name
    (job_dir / "logs").mkdir(parents=True)
    (job_dir / "token").write_text(TOKEN + "\n")
    store = Store(tg.state_dir)
    try:
        store.create_job(name, name, "test", job_dir, 2, 1, {})
        store.update_job(name, phase="Running")
        here = NodeRow("node-0", "running", node_rank=0, ranks=(0,), attempt=0,
                       agent_url="http://127.0.0.1:9", host="host0")  # fmt: skip
        there = NodeRow("node-1", "running", node_rank=1, ranks=(1,), attempt=0,
                        agent_url=agent_url, host="host1")  # fmt: skip
        store.upsert_nodes(name, [here, there])
    finally:
        store.close()
    return name


def _get(agent: AgentProcess, query: str, token: str = TOKEN) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        f"http://{OTHER_HOST}:{agent.port}/logs?{query}",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_logs_rank_reads_a_rank_of_another_host_through_its_agent(
    other_host: AgentProcess, tg: Trainguard
) -> None:
    logs = other_host.log_dir
    old = b"=== trainguard: attempt 0 ===\nrotated away\n"
    new = b"=== trainguard: attempt 1 ===\n" + b"x" * (MAX_CHUNK + 100) + b"\nStep 7\n"
    (logs / "rank-1.log.1").write_bytes(old)
    (logs / "rank-1.log").write_bytes(new)
    job = _job(tg, f"http://{OTHER_HOST}:{other_host.port}", "remote-read")
    done = tg.run("logs", job, "--rank", "1", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.encode() == old + new  # paged: more than one reply's worth

    # --follow reads on as the rank writes, until the job ends.
    follow = tg.popen("logs", job, "--rank", "1", "--follow")
    try:
        time.sleep(1.0)
        with open(logs / "rank-1.log", "ab") as f:
            f.write(b"Step 8\n")
        time.sleep(1.0)
        store = Store(tg.state_dir)
        try:
            store.update_job(job, phase="Succeeded")
        finally:
            store.close()
        out, err = follow.communicate(timeout=60)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0, err
    assert out.encode() == old + new + b"Step 8\n"


def test_logs_rank_of_a_host_that_is_gone_says_where_the_log_is(
    other_host: AgentProcess, tg: Trainguard
) -> None:
    gone = f"http://{OTHER_HOST}:9"  # nothing listens there
    job = _job(tg, gone, "remote-gone")
    done = tg.run("logs", job, "--rank", "1", timeout=60)
    assert done.returncode == 1, done
    assert f"node-1's host {OTHER_HOST} does not answer" in done.stderr, done.stderr
    assert f"jobs/{job}/logs/rank-1.log" in done.stderr, done.stderr


def test_the_agent_serves_a_rank_number_not_a_path(
    other_host: AgentProcess, tmp_path: Path
) -> None:
    logs = other_host.log_dir
    (logs / "rank-5.log").write_bytes(b"five\n")
    status, body = _get(other_host, "rank=5&offset=2")
    assert status == 200 and body["size"] == 5 and body["offset"] == 2, body
    for query in (
        "rank=../../etc/passwd",
        "rank=-1",
        "rank=5&rank=6",
        "offset=0",
        "rank=5&offset=x",
    ):
        status, body = _get(other_host, query)
        assert status == 400, (query, body)
    assert _get(other_host, "rank=6")[0] == 404
    assert _get(other_host, "rank=5", token="wrong-token-entirely")[0] == 401
    secret = tmp_path / "secret"
    secret.write_text("not a log\n")
    os.symlink(secret, logs / "rank-9.log")
    status, body = _get(other_host, "rank=9")
    assert status == 409 and "symbolic link" in str(body["error"]), body


def test_a_missing_remote_log_is_said(other_host: AgentProcess, tg: Trainguard) -> None:
    job = _job(tg, f"http://{OTHER_HOST}:{other_host.port}", "remote-missing")
    (other_host.log_dir / "rank-1.log").unlink(missing_ok=True)
    done = tg.run("logs", job, "--rank", "1", timeout=60)
    assert done.returncode == 1 and "no log of rank 1 on this host" in done.stderr, done
