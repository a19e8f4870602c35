"""The local platform end to end, with light fake workers (no torch): CLI, agents, store."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sqlite3
import stat
import subprocess
from pathlib import Path

from conftest import FAKE_WORKER, REPO, Trainguard, pid_alive, wait_for, worker_pids, write_job
from trainguard.cli import main
from trainguard.platform.local import MEMORY_ROOT
from trainguard.platform.store import DB_NAME, Store

TORCHRUN_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_MAX_RESTARTS",
)


def test_torchrun_form_runs_every_rank_with_the_torchrun_env(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = tg.run(
        "run", "--nnodes", "2", "--nproc-per-node", "2", str(FAKE_WORKER), "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    for rank in range(4):
        assert f"[rank{rank}]: hello from rank {rank} attempt 0" in done.stdout
    records = {r: json.loads((out / f"rank-{r}-attempt-0.json").read_text()) for r in range(4)}
    ports = {rec["env"]["MASTER_PORT"] for rec in records.values()}
    assert len(ports) == 1
    for rank, rec in records.items():
        env = rec["env"]
        assert all(k in env for k in TORCHRUN_KEYS)
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["OMP_NUM_THREADS"] == "1"
    job = tg.only_job()
    assert job["phase"] == "Succeeded"
    assert [n["ranks"] for n in job["nodes"]] == [[0, 1], [2, 3]]
    assert [a["phase"] for a in job["attempts"]] == ["Succeeded"]
    kinds = [e["kind"] for e in job["events"]]
    assert kinds[0] == "JobStarted" and kinds[-1] == "JobSucceeded"
    # Logs: per rank, and the whole console; after the job ended.
    rank3 = tg.run("logs", job["id"], "--rank", "3")
    assert "hello from rank 3 attempt 0" in rank3.stdout
    assert "stderr line from rank 3" in rank3.stdout
    console = tg.run("logs", job["id"])
    assert "[rank1]: hello from rank 1" in console.stdout
    text = tg.run("describe", job["id"])
    assert "Nodes:" in text.stdout and "node-1" in text.stdout and "Events:" in text.stdout
    assert not any(pid_alive(p) for p in worker_pids(out))


def test_crash_is_restarted_within_budget(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tg.run(
        "run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        str(FAKE_WORKER),
        "--out",
        str(out),
        "--fail-rank",
        "3",
        "--fail-attempts",
        "1",
        "--sleep",
        "1",
    )
    assert done.returncode == 0, done.stderr
    job = tg.only_job()
    assert job["phase"] == "Succeeded"
    assert job["restarts"] == 1
    assert [a["phase"] for a in job["attempts"]] == ["Failed", "Succeeded"]
    assert job["attempts"][0]["master_port"] != job["attempts"][1]["master_port"]
    faults = [e for e in job["events"] if e["kind"] == "Fault"]
    assert faults[0]["rank"] == 3 and "exit code 3" in faults[0]["message"]
    env1 = json.loads((out / "rank-0-attempt-1.json").read_text())["env"]
    assert env1["TORCHELASTIC_RESTART_COUNT"] == "1" and env1["TRAINGUARD_ATTEMPT"] == "1"
    assert not any(pid_alive(p) for p in worker_pids(out))


def test_budget_exhausted_fails_with_reason(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = tg.run(
        "run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(FAKE_WORKER),
        "--out",
        str(out),
        "--fail-rank",
        "1",
        "--fail-attempts",
        "-1",
        "--exit-code",
        "7",
        "--sleep",
        "30",
    )
    assert done.returncode == 1
    assert "rank 1 exited with exit code 7" in done.stderr
    assert "retry budget exhausted" in done.stderr
    job = tg.only_job()
    assert job["phase"] == "Failed" and "(--max-restarts=1, restarts=1)" in job["reason"]
    assert not any(pid_alive(p) for p in worker_pids(out))


def test_missing_script_is_exit_2_and_starts_nothing(tg: Trainguard, tmp_path: Path) -> None:
    done = tg.run("run", "--nnodes", "2", str(tmp_path / "nope.py"))
    assert done.returncode == 2
    assert "nope.py" in done.stderr
    assert tg.run("list", "-o", "json").stdout.strip() == "[]"


def test_bad_spec_names_the_field(tg: Trainguard, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "apiVersion: trainguard.dev/v1\nkind: TrainingJob\nmetadata: {name: bad}\n"
        "spec:\n  nprocPerNode: '1'\n  replicaSpecs:\n    - name: pods\n      replicas: 0\n"
        "      template: {spec: {containers: [{name: t, command: [python, x.py]}]}}\n"
    )
    done = tg.run("run", "-f", str(spec))
    assert done.returncode == 2
    assert "spec.replicaSpecs[0].replicas" in done.stderr
    assert tg.run("list", "-o", "json").stdout.strip() == "[]"


def test_bad_flag_is_exit_2(tg: Trainguard) -> None:
    done = tg.run("run", "--nnodes", "zero", "x.py")
    assert done.returncode == 2 and "--nnodes" in done.stderr


def test_ctrl_c_stops_every_worker(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = tg.popen(
        "run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        str(FAKE_WORKER),
        "--out",
        str(out),
        "--sleep",
        "120",
    )
    wait_for(lambda: len(list(out.glob("rank-*.json"))) == 4)
    pids = worker_pids(out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    assert tg.only_job()["phase"] == "Stopped"


def test_delete_stops_a_running_job_and_removes_it(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = tg.popen(
        "run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        str(FAKE_WORKER),
        "--out",
        str(out),
        "--sleep",
        "120",
    )
    wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2)
    pids = worker_pids(out)
    job_id = json.loads(tg.run("list", "-o", "json").stdout)[0]["id"]
    done = tg.run("delete", job_id)
    assert done.returncode == 0, done.stderr
    proc.communicate(timeout=60)
    assert proc.returncode == 1
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    assert tg.run("list", "-o", "json").stdout.strip() == "[]"
    assert tg.run("describe", job_id).returncode == 2


def test_unknown_job_is_exit_2(tg: Trainguard) -> None:
    done = tg.run("describe", "nope")
    assert done.returncode == 2 and "nope" in done.stderr


def test_killed_controller_without_grace_leaves_no_orphans(tg: Trainguard, tmp_path: Path) -> None:
    # controllerGraceSeconds: 0 — the agents die with their controller (the default keeps
    # them training for `trainguard resume`: tests/test_run_resume.py).
    out = tmp_path / "out"
    command = ["python", str(FAKE_WORKER), "--out", str(out), "--sleep", "120"]
    spec = write_job(
        tmp_path / "job.yaml", "orphans", command, nprocPerNode=1,
        trainguard={"controllerGraceSeconds": 0},
    )  # fmt: skip
    proc = tg.popen("run", "-f", str(spec))
    wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2)
    pids = worker_pids(out)
    job = tg.only_job()
    memory = MEMORY_ROOT / job["id"]
    assert memory.is_dir()
    proc.kill()
    proc.communicate(timeout=30)
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    job = tg.only_job()
    assert job["phase"] == "Lost"
    # Issue 38: the nodes' memory tiers (RAM) were left behind; nobody resumes from them.
    wait_for(lambda: not any(pid_alive(n["agent_pid"]) for n in job["nodes"]), timeout=30)
    wait_for(lambda: not memory.exists(), timeout=30)  # the last agent out removes it


def test_heartbeat_timeout_is_a_hang_of_that_rank(tg: Trainguard, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "apiVersion: trainguard.dev/v1\nkind: TrainingJob\nmetadata: {name: beats}\n"
        "spec:\n  nprocPerNode: 2\n  replicaSpecs:\n    - name: pods\n      replicas: 1\n"
        "      template: {spec: {containers: [{name: t, command: [python, "
        f"{FAKE_WORKER}, --out, {tmp_path / 'out'}, --beats, '40', --freeze-rank, '1']}}]}}}}\n"
        "  runPolicy: {jobMaxRetryCount: 1}\n"
        "  trainguard: {heartbeatTimeoutSeconds: 2}\n"
    )
    done = tg.run("run", "-f", str(spec))
    assert done.returncode == 0, done.stderr
    job = tg.only_job()
    [fault] = job["faults"]
    assert fault["type"] == "HeartbeatTimeout" and fault["rank"] == 1
    assert "rank 1 sent no heartbeat" in fault["message"]
    assert "1" in fault["evidence"]["stacks"]  # the stuck rank's stack was captured
    assert job["restarts"] == 1


def test_bad_inject_spec_is_exit_2(tg: Trainguard) -> None:
    done = tg.run("run", "--inject", "kill:rank=x@step=1", str(FAKE_WORKER), "--out", "/tmp/x")
    assert done.returncode == 2 and "kill:rank=x@step=1" in done.stderr
    done = tg.run(
        "run",
        "--nnodes",
        "1",
        "--inject",
        "kill:rank=5@step=1",
        str(FAKE_WORKER),
        "--out",
        "/tmp/x",
    )
    assert done.returncode == 2 and "rank=5" in done.stderr
    assert tg.run("list", "-o", "json").stdout.strip() == "[]"


def test_a_state_directory_from_an_older_trainguard_is_upgraded(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute(
        "CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, phase TEXT NOT NULL, "
        "reason TEXT, source TEXT, job_dir TEXT NOT NULL, nnodes INTEGER NOT NULL, "
        "nproc_per_node INTEGER NOT NULL, restarts INTEGER NOT NULL DEFAULT 0, "
        "controller_pid INTEGER, desired TEXT, created_at REAL NOT NULL, started_at REAL, "
        "finished_at REAL, spec_json TEXT NOT NULL)"
    )
    db.close()
    store = Store(tmp_path)
    store.create_job("j-1", "j", "job.yaml", tmp_path / "j-1", 1, 1, {})
    store.update_job("j-1", faults=[{"type": "WorkerCrash"}])
    assert store.job("j-1").phase
    store.close()


def test_a_rank_that_raises_fails_the_job_saying_why(tg: Trainguard, tmp_path: Path) -> None:
    """torchrun's form, as the friction report ran it: --standalone is accepted, the
    budget is 3 restarts and its message names --max-restarts, the reason quotes the
    exception, and 2 simulated nodes x 1 process share this machine's cores."""
    out = tmp_path / "out"
    done = tg.run(
        "run", "--standalone", "--nnodes", "2", "--nproc-per-node", "1",
        str(FAKE_WORKER), "--out", str(out), "--raise-rank", "1",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    why = "rank 1 exited with exit code 1: ValueError: lr must be positive"
    assert f"{why}; retry budget exhausted (--max-restarts=3, restarts=3)" in done.stderr
    job = tg.only_job()
    assert (job["phase"], job["restarts"], len(job["attempts"])) == ("Failed", 3, 4)
    assert job["reason"].startswith(why)
    assert job["faults"][0]["evidence"]["error"] == "ValueError: lr must be positive"
    assert [e["message"] for e in job["events"] if e["kind"] == "JobFailed"] == [job["reason"]]
    assert f"Reason:    {why}" in tg.run("describe", job["id"]).stdout
    # Rank 1's record: it writes it before it raises (rank 0 may be stopped before its own).
    env = json.loads((out / "rank-1-attempt-0.json").read_text())["env"]
    assert env["OMP_NUM_THREADS"] == "1"  # 2 workers on this machine, though 1 per node
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert "TRAINGUARD_HOST_WORKERS" not in env


def test_standalone_is_not_a_multi_host_job(tg: Trainguard) -> None:
    done = tg.run("run", "--standalone", "--rdzv-endpoint", "h:1", str(FAKE_WORKER))
    assert done.returncode == 2 and "--standalone" in done.stderr


def test_a_specs_missing_script_is_exit_2_naming_it(tg: Trainguard, tmp_path: Path) -> None:
    spec = write_job(tmp_path / "job.yaml", "missing", ["python", "no_such_train.py"])
    done = tg.run("run", "-f", str(spec))
    assert done.returncode == 2
    assert f"script no_such_train.py: not found (relative to {REPO})" in done.stderr
    assert tg.run("list", "-o", "json").stdout.strip() == "[]"


def cli(tg: Trainguard, *args: str) -> tuple[int, str, str]:
    """``trainguard ARGS`` in this process (no interpreter to start): code, out, err."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, "--state-dir", str(tg.state_dir)])
    return code, out.getvalue(), err.getvalue()


def test_stop_keeps_the_job_and_delete_keeps_its_checkpoints(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = ("run", "--max-restarts", "0", "--name", "keep", str(FAKE_WORKER), "--out", str(out))
    proc = tg.popen(*argv, "--sleep", "120")
    wait_for(lambda: len(list(out.glob("rank-*.json"))) == 1)
    pids = worker_pids(out)
    job_id = json.loads(cli(tg, "list", "-o", "json")[1])[0]["id"]
    # Its controller answers the doorbell that `stop` rings (platform/doorbell.py): the
    # ask is read at once, not at the loop's next turn.
    bell = Path(json.loads(cli(tg, "describe", job_id, "-o", "json")[1])["job_dir"]) / "doorbell"
    assert stat.S_ISFIFO(bell.stat().st_mode)
    assert cli(tg, "stop", job_id) == (0, f"job {job_id} stopped\n", "")
    proc.communicate(timeout=60)
    wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30)
    job = json.loads(cli(tg, "describe", job_id, "-o", "json")[1])
    assert (job["phase"], job["reason"]) == ("Stopped", "stopped by user")
    assert not bell.exists()  # gone with its controller
    assert "hello from rank 0" in cli(tg, "logs", job_id)[1]  # the record stays
    assert cli(tg, "stop", job_id)[1] == f"job {job_id} is already Stopped\n"

    # A second job of that name: the name no longer picks one.
    assert tg.run(*argv).returncode == 0
    ids = [j["id"] for j in json.loads(cli(tg, "list", "-o", "json")[1])]
    code, _, err = cli(tg, "describe", "keep")
    assert code == 2
    assert f"2 jobs are named 'keep': {ids[1]}, {ids[0]}; give one of these ids" in err

    job_dir = Path(job["job_dir"])
    (job_dir / "checkpoints").mkdir()
    (job_dir / "checkpoints" / "step-10.pt").write_text("weights")
    code, printed, _ = cli(tg, "delete", job_id)
    assert code == 0 and f"its checkpoints are kept: {job_dir / 'checkpoints'}" in printed
    assert (job_dir / "checkpoints" / "step-10.pt").exists()
    assert not (job_dir / "logs").exists() and cli(tg, "describe", job_id)[0] == 2

    other = Path(json.loads(cli(tg, "describe", "keep", "-o", "json")[1])["job_dir"])
    (other / "durable").mkdir()
    code, printed, _ = cli(tg, "delete", "--checkpoints", "keep")  # one job of that name now
    assert code == 0 and "kept" not in printed
    assert not other.exists()


def test_output_into_a_closed_pipe_is_no_traceback(tg: Trainguard) -> None:
    """`trainguard list | head` printed a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            tg.argv("list"), env=tg.env, stdout=write, stderr=subprocess.PIPE, text=True,
            cwd=REPO, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 141
    assert done.stderr == ""
