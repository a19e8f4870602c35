"""`delete` signals a recorded pid only while it still names the recorded process."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import FAKE_WORKER, Trainguard, pid_alive, wait_for, worker_pids
from trainguard.platform.local import MEMORY_ROOT
from trainguard.platform.procs import is_recorded, kill_recorded, runs, start_time
from trainguard.platform.store import NodeRow, Store


@pytest.fixture
def bystanders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Unrelated processes (each leading its own group, like agents); killed after the test."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _bystander(procs: list[subprocess.Popen[bytes]]) -> int:
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    procs.append(proc)
    return proc.pid


def _dead_pid() -> tuple[int, str | None]:
    """The pid and start time of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    started = start_time(proc.pid)
    proc.wait()
    return proc.pid, started


def _reused(pid: int) -> str:
    """A start time that ``pid``'s process does not have: as if the pid had been reused."""
    started = start_time(pid)
    assert started is not None
    boot, ticks = started.rsplit(":", 1)
    return f"{boot}:{int(ticks) - 1}"


def _job(
    tg: Trainguard,
    controller: tuple[int, str | None],
    agent: tuple[int, str | None] | None = None,
    worker: tuple[int, str | None] | None = None,
    phase: str = "Running",
) -> str:
    """Record a job as a controller would: its controller, one node's agent and worker."""
    job_id = f"pids-{secrets.token_hex(3)}"
    store = Store(tg.state_dir)
    job_dir = tg.state_dir / "jobs" / job_id
    (job_dir / "logs").mkdir(parents=True)
    store.create_job(job_id, "pids", "test", job_dir, 1, 1, {})
    store.update_job(
        job_id, phase=phase, controller_pid=controller[0], controller_started=controller[1]
    )
    if agent is not None:
        workers = [worker] if worker is not None else []
        row = NodeRow(
            "pods-0",
            "running",
            node_rank=0,
            ranks=(0,),
            attempt=0,
            agent_pid=agent[0],
            agent_started=agent[1],
            worker_pids=tuple(w[0] for w in workers),
            worker_starts=tuple(w[1] for w in workers),
        )
        store.upsert_nodes(job_id, [row])
    store.close()
    return job_id


def _jobs(tg: Trainguard) -> list[dict[str, object]]:
    done = tg.run("list", "-o", "json", timeout=60)
    assert done.returncode == 0, done.stderr
    jobs: list[dict[str, object]] = json.loads(done.stdout)
    return jobs


def test_start_time_pins_a_pid_to_one_process(
    bystanders: list[subprocess.Popen[bytes]],
) -> None:
    me = start_time(os.getpid())
    assert me is not None and me == start_time(os.getpid())
    assert is_recorded(os.getpid(), me) and runs(os.getpid(), me)
    pid = _bystander(bystanders)
    assert not kill_recorded(pid, _reused(pid))  # a reused pid
    assert not kill_recorded(pid, None)  # no start time recorded: never signalled
    assert not runs(pid, _reused(pid)) and not runs(pid, None)
    assert bystanders[0].poll() is None
    dead, started = _dead_pid()
    assert not is_recorded(dead, started) and not kill_recorded(dead, started)
    assert kill_recorded(pid, start_time(pid))
    assert bystanders[0].wait(timeout=10) == -9


def test_delete_never_signals_a_reused_pid(
    tg: Trainguard, bystanders: list[subprocess.Popen[bytes]]
) -> None:
    # Every recorded pid now names an unrelated live process (a reused pid).
    controller, agent, worker = (_bystander(bystanders) for _ in range(3))
    job_id = _job(
        tg,
        (controller, _reused(controller)),
        agent=(agent, _reused(agent)),
        worker=(worker, _reused(worker)),
    )
    # A reused controller pid does not make the job look alive.
    [job] = _jobs(tg)
    assert job["phase"] == "Lost"
    assert tg.describe(job_id)["phase"] == "Lost"
    done = tg.run("delete", job_id, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"job {job_id} deleted" in done.stdout
    for pid in (agent, worker):
        assert f"left pid {pid} alone" in done.stderr
    assert all(p.poll() is None for p in bystanders)  # nothing was signalled
    assert _jobs(tg) == []
    assert not (tg.state_dir / "jobs" / job_id).exists()


def test_delete_of_a_lost_job_kills_its_recorded_processes(
    tg: Trainguard, bystanders: list[subprocess.Popen[bytes]]
) -> None:
    agent, worker = _bystander(bystanders), _bystander(bystanders)
    job_id = _job(
        tg, _dead_pid(), agent=(agent, start_time(agent)), worker=(worker, start_time(worker))
    )
    done = tg.run("delete", job_id, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [p.wait(timeout=10) for p in bystanders] == [-9, -9]


def test_force_deletes_a_lost_job_and_its_memory_tier(tg: Trainguard) -> None:
    dead = _dead_pid()
    job_id = _job(tg, dead, agent=_dead_pid(), worker=_dead_pid(), phase="Restarting")
    memory = MEMORY_ROOT / job_id / "pods-0" / "memory"
    memory.mkdir(parents=True)
    (memory / "rank-0-slot-0.data").write_bytes(b"x" * 4096)
    try:
        done = tg.run("delete", "--force", job_id, timeout=60)
        assert done.returncode == 0, done.stderr
        assert _jobs(tg) == []
        assert not (MEMORY_ROOT / job_id).exists()
        assert not (tg.state_dir / "jobs" / job_id).exists()
    finally:
        shutil.rmtree(MEMORY_ROOT / job_id, ignore_errors=True)


def test_force_kills_a_controller_that_does_not_stop(
    tg: Trainguard, bystanders: list[subprocess.Popen[bytes]]
) -> None:
    # A live controller that never answers the delete request (hung).
    controller = _bystander(bystanders)
    job_id = _job(tg, (controller, start_time(controller)))
    done = tg.run("delete", "--timeout", "0.5", job_id, timeout=60)
    assert done.returncode == 1
    assert "left in place (delete --force kills it)" in done.stderr
    assert bystanders[0].poll() is None and len(_jobs(tg)) == 1
    done = tg.run("delete", "--timeout", "0.5", "--force", job_id, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "killed its controller" in done.stderr
    assert bystanders[0].wait(timeout=10) == -9
    assert _jobs(tg) == []


def test_pids_recorded_by_a_run_carry_their_start_times(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = tg.popen(
        "run", "--nnodes", "1", "--nproc-per-node", "2", str(FAKE_WORKER),
        "--out", str(out), "--sleep", "120",
    )  # fmt: skip
    try:
        wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2, timeout=120)
        pids = sorted(worker_pids(out))
        store = Store(tg.state_dir)
        try:

            def recorded() -> bool:
                nodes = store.nodes(store.jobs()[0].id)
                return bool(nodes) and sorted(nodes[0]["worker_pids"]) == pids

            wait_for(recorded, timeout=60)
            job = store.jobs()[0]
            [node] = store.nodes(job.id)
        finally:
            store.close()
        assert job.controller_pid == proc.pid
        assert job.controller_started == start_time(proc.pid)
        assert node["agent_started"] == start_time(node["agent_pid"])
        assert node["worker_starts"] == [start_time(p) for p in node["worker_pids"]]
        done = tg.run("delete", job.id)
        assert done.returncode == 0, done.stderr
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def test_delete_of_a_killed_controllers_job_kills_what_is_left(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = tg.popen(
        "run", "--nnodes", "2", "--nproc-per-node", "1", str(FAKE_WORKER),
        "--out", str(out), "--sleep", "120",
    )  # fmt: skip
    wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2, timeout=120)
    pids = worker_pids(out)
    proc.kill()  # the agents may keep their workers for a grace period: delete ends them
    proc.communicate(timeout=60)
    [job] = _jobs(tg)
    assert job["phase"] == "Lost"
    memory = MEMORY_ROOT / str(job["id"])
    done = tg.run("delete", str(job["id"]), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "left pid" not in done.stderr
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    assert _jobs(tg) == [] and not memory.exists()


def test_describe_shows_a_remote_nodes_worker_pids_with_their_host_and_delete_spares_them(
    tg: Trainguard, bystanders: list[subprocess.Popen[bytes]]
) -> None:
    """Issue 39: `describe -o json` had no pids for the workers of a node on another
    host. They are shown with the host's name; `delete` never signals them (a pid of
    another machine names some other process here: a bystander stands in for it)."""
    there = _bystander(bystanders)
    job_id = _job(tg, _dead_pid())
    store = Store(tg.state_dir)
    try:
        remote = NodeRow("node-1", "running", node_rank=1, ranks=(1, 2), attempt=0,
                         agent_url="http://10.0.0.3:4000", host="host1",
                         workers=((2, there + 1), (1, there)))  # fmt: skip
        store.upsert_nodes(job_id, [remote])
    finally:
        store.close()
    [node] = tg.describe(job_id)["nodes"]
    assert (node["host"], node["worker_pids"], node["agent_pid"]) == ("host1", [], None)
    assert node["workers"] == [{"rank": 2, "pid": there + 1}, {"rank": 1, "pid": there}]
    text = tg.run("describe", job_id, timeout=60).stdout
    [row] = [line for line in text.splitlines() if line.strip().startswith("node-1")]
    assert f"host1  {there},{there + 1}  http://10.0.0.3:4000" in row, text
    done = tg.run("delete", job_id, timeout=60)
    assert done.returncode == 0, done.stderr
    assert all(p.poll() is None for p in bystanders)  # nothing was signalled
