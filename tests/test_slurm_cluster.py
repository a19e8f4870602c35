"""The Slurm harness (tests/slurm_cluster.py): a real slurmctld, munged and one slurmd per
namespace host.

The first tests are pure (the parsers, slurm.conf, the refusal to install without root);
the others need root (to install Slurm when it is missing and to make namespace hosts) and
skip otherwise. Processes are compared by pid and start time: on a busy machine pids come
round again within seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

import slurm_cluster as harness
from conftest import pid_alive, wait_for
from netns_hosts import NamespaceHosts, unavailable_reason
from slurm_cluster import SlurmCluster
from slurm_conf import node_states, parse_record, slurm_conf

MakeCluster = Callable[..., SlurmCluster]

# Every task appends "<hostname> <restart count>" to beat-<hostname> twice a second.
HEARTBEAT = (
    'sh -c \'while :; do echo "$(hostname) ${SLURM_RESTART_COUNT:-0}" >> beat-$(hostname);'
    " sleep 0.5; done'"
)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def started(pids: Iterable[int]) -> dict[int, str]:
    """``pids`` that live, with their start times: pids are reused within seconds on a busy
    machine (pid_max 32768), so a process is the same only if its start time is."""
    return {pid: t for pid in pids if pid_alive(pid) and (t := harness.start_time(pid))}


def survivors(procs: dict[int, str]) -> dict[int, str]:
    """The processes of ``procs`` (from :func:`started`) still alive, with command lines."""
    alive = {}
    for pid, t in procs.items():
        if pid_alive(pid) and harness.start_time(pid) == t:
            with contextlib.suppress(OSError):
                alive[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return alive


def test_parse_record_keeps_spaces_and_equals_inside_values() -> None:
    line = (
        "NodeName=node1 Arch=x86_64 CoresPerSocket=1  State=IDLE+DRAIN "
        "CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES= "
        "Reason=trainguard: test [root@2026-01-01T00:00:00] Socks/Node=* NtasksPerN:B:S:C=0:0:*:*\n"
    )
    assert parse_record(line) == {
        "NodeName": "node1",
        "Arch": "x86_64",
        "CoresPerSocket": "1",
        "State": "IDLE+DRAIN",
        "CfgTRES": "cpu=2,mem=1M,billing=2",
        "AllocTRES": "",
        "Reason": "trainguard: test [root@2026-01-01T00:00:00]",
        "Socks/Node": "*",
        "NtasksPerN:B:S:C": "0:0:*:*",
    }


def test_node_states_reads_flags_and_not_responding() -> None:
    assert node_states("IDLE") == {"IDLE"}
    assert node_states("DOWN*+DRAIN") == {"DOWN", "NOT_RESPONDING", "DRAIN"}
    assert node_states("MIXED+NOT_RESPONDING") == {"MIXED", "NOT_RESPONDING"}


def test_slurm_conf_has_a_node_per_host_one_partition_and_extra_keys() -> None:
    conf = slurm_conf(
        cluster_name="tgx",
        controller=("vm", "10.200.0.1"),
        port=7000,
        directory=Path("/run/x"),
        nodes={"node0": "10.200.0.2", "node1": "10.200.0.3"},
        partition="tg",
        cpus=4,
        extra={"SlurmdTimeout": "30", "PrologFlags": "Contain"},
    ).splitlines()
    assert "SlurmctldHost=vm(10.200.0.1)" in conf
    assert "AuthInfo=socket=/run/x/munge/munge.socket,cred_expire=10" in conf
    assert "SlurmdTimeout=30" in conf and "SlurmdTimeout=10" not in conf
    assert "PrologFlags=Contain" in conf
    assert conf[-3:] == [
        "NodeName=node0 NodeAddr=10.200.0.2 CPUs=4 State=UNKNOWN",
        "NodeName=node1 NodeAddr=10.200.0.3 CPUs=4 State=UNKNOWN",
        "PartitionName=tg Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]


def test_install_is_refused_with_a_reason_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = "Slurm is not installed and installing it needs root"
    assert harness.ensure_installed() == reason

    def no_hosts(count: int, prefix: str | None = None) -> NamespaceHosts:
        raise AssertionError("no hosts without Slurm")

    with harness.factory(no_hosts) as make, pytest.raises(pytest.skip.Exception) as e:
        make(1)
    assert "needs root" in str(e.value)


@pytest.mark.long
def test_comes_up_with_every_host_an_idle_node(slurm_cluster: MakeCluster) -> None:
    cluster = slurm_cluster(3)
    for host in cluster.hosts.hosts:
        node = cluster.node(host.name)
        assert node["State"] == "IDLE"
        assert node["NodeAddr"] == host.addr
        assert node["Partitions"] == "tg"
        assert node["CPUTot"] == "2"
    assert set(cluster.pids) == {
        "munged",
        "slurmctld",
        "slurmd-node0",
        "slurmd-node1",
        "slurmd-node2",
    }
    assert all(pid_alive(pid) for pid in cluster.pids.values())
    # slurmd runs inside its host's network namespace, slurmctld outside.
    for host in cluster.hosts.hosts:
        assert cluster.pids[f"slurmd-{host.name}"] in cluster.hosts.pids(host)
    squeue = cluster.command("squeue", "-h", host=cluster.hosts[2])  # a client on a host
    assert squeue.stdout == ""


@pytest.mark.long
def test_batch_job_srun_runs_on_two_namespace_hosts(slurm_cluster: MakeCluster) -> None:
    cluster = slurm_cluster(3)
    # Submitted from the machine, and from inside a host.
    for host in (None, cluster.hosts[2]):
        job_id = cluster.sbatch("srun hostname\n", "-N2", host=host)
        job = cluster.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=30)
        assert job["JobState"] == "COMPLETED", cluster.output(job_id)
        names = sorted(cluster.output(job_id).split())
        assert len(names) == 2 and len(set(names)) == 2
        assert set(names) <= {h.name for h in cluster.hosts.hosts}
        expanded = cluster.scontrol("show", "hostnames", job["NodeList"]).split()
        assert sorted(expanded) == names
    # srun on its own (an allocation and a step), from the machine and from a host.
    for host in (None, cluster.hosts[2]):
        names = cluster.command("srun", "-N3", "hostname", host=host).stdout.split()
        assert sorted(names) == ["node0", "node1", "node2"]


@pytest.mark.long
def test_drain_with_a_reason_and_resume(slurm_cluster: MakeCluster) -> None:
    cluster = slurm_cluster(2)
    cluster.scontrol("update", "nodename=node1", "state=drain", "reason=trainguard: test")
    node = cluster.node("node1")
    assert node_states(node["State"]) == {"IDLE", "DRAIN"}
    assert node["Reason"].startswith("trainguard: test [")
    # A drained node takes no job: a job on 2 nodes waits.
    job_id = cluster.sbatch("srun hostname\n", "-N2")
    assert cluster.wait_state(job_id, {"PENDING"}, timeout=10)["JobState"] == "PENDING"
    cluster.scontrol("update", "nodename=node1", "state=resume")
    assert cluster.wait_state(job_id, {"COMPLETED"}, timeout=30)["NodeList"] == "node[0-1]"
    assert cluster.node("node1")["State"] == "IDLE"


@pytest.mark.long
def test_cut_node_goes_down_and_a_no_kill_job_runs_on(slurm_cluster: MakeCluster) -> None:
    cluster = slurm_cluster(3)
    job_id = cluster.sbatch(
        f"srun --no-kill {HEARTBEAT}\n", "-N2", "-w", "node0,node1", "--no-kill"
    )
    job = cluster.wait_state(job_id, {"RUNNING"}, timeout=30)
    assert job["BatchHost"] == "node0"
    beat0, beat1 = cluster.jobs_dir / "beat-node0", cluster.jobs_dir / "beat-node1"
    wait_for(lambda: lines(beat0) and lines(beat1), timeout=30)
    cluster.hosts.cut(cluster.hosts[1])
    start = time.monotonic()
    down = cluster.wait_node("node1", lambda s: "DOWN" in s, timeout=60)
    print(f"node1 DOWN {time.monotonic() - start:.1f}s after the cut: {down['State']}")
    assert "NOT_RESPONDING" in node_states(down["State"])
    assert down["Reason"].startswith("Not responding")
    # The job lost node1 and kept node0; its step's task on node0 still beats.
    job = cluster.job(job_id)
    assert (job["JobState"], job["NodeList"]) == ("RUNNING", "node0")
    seen = len(lines(beat0))
    wait_for(lambda: len(lines(beat0)) >= seen + 4, timeout=10)
    assert cluster.job(job_id)["JobState"] == "RUNNING"


@pytest.mark.long
def test_requeue_runs_the_job_again(slurm_cluster: MakeCluster) -> None:
    cluster = slurm_cluster(2)
    job_id = cluster.sbatch(f"srun {HEARTBEAT}\n", "-N1", "-w", "node0")
    cluster.wait_state(job_id, {"RUNNING"}, timeout=30)
    beat = cluster.jobs_dir / "beat-node0"
    wait_for(lambda: lines(beat), timeout=30)
    start = time.monotonic()
    cluster.scontrol("requeue", str(job_id))
    wait_for(lambda: "node0 1" in lines(beat), timeout=60)
    print(f"requeued job beating again {time.monotonic() - start:.1f}s after the requeue")
    job = cluster.job(job_id)
    assert (job["JobState"], job["Restarts"]) == ("RUNNING", "1")
    assert lines(beat)[0] == "node0 0"


@pytest.mark.long
def test_scancel_ends_the_job_and_its_processes(slurm_cluster: MakeCluster) -> None:
    cluster = slurm_cluster(2)
    script = "sleep 300 &\necho $$ $! > pids\nsrun sleep 300\n"
    job_id = cluster.sbatch(script, "-N1", "-w", "node1")
    cluster.wait_state(job_id, {"RUNNING"}, timeout=30)
    step = f"{job_id}.0"  # srun's step, listed once launched
    wait_for(lambda: step in cluster.command("squeue", "-h", "-s", "-o", "%i").stdout.split())
    wait_for(lambda: (cluster.jobs_dir / "pids").exists())
    script_pids = [int(p) for p in (cluster.jobs_dir / "pids").read_text().split()]
    slurmd = cluster.pids["slurmd-node1"]
    # The batch shell and its sleep, slurmstepds, srun, the step's sleep: all on node1.
    procs = started({*script_pids, *cluster.hosts.pids(cluster.hosts[1])} - {slurmd})
    assert set(script_pids) <= set(procs)
    start = time.monotonic()
    cluster.command("scancel", str(job_id))
    assert cluster.wait_state(job_id, {"CANCELLED"}, timeout=30)["JobState"] == "CANCELLED"
    try:
        wait_for(lambda: not survivors(procs), timeout=60)
    except AssertionError:
        raise AssertionError(f"alive 60 s after scancel: {survivors(procs)}") from None
    print(f"job and its {len(procs)} processes gone {time.monotonic() - start:.1f}s after scancel")
    assert cluster.hosts.pids(cluster.hosts[1]) == [slurmd]


@pytest.mark.long
def test_teardown_leaves_no_daemon_no_process_and_no_namespace() -> None:
    reason = harness.ensure_installed() or unavailable_reason()
    if reason:
        pytest.skip(reason)
    hosts = NamespaceHosts(2)
    try:
        cluster = SlurmCluster(hosts)
        job_id = cluster.sbatch("srun -N2 sleep 300\n", "-N2")
        cluster.wait_state(job_id, {"RUNNING"}, timeout=30)
        step = f"{job_id}.0"
        wait_for(lambda: step in cluster.command("squeue", "-h", "-s", "-o", "%i").stdout.split())
        procs = started({*cluster.processes(), *cluster.pids.values()})
        assert set(cluster.pids.values()) <= set(procs)
        start = time.monotonic()
        cluster.close()
        print(f"cluster closed in {time.monotonic() - start:.2f}s")
    finally:
        hosts.close()
    assert survivors(procs) == {}
    assert not cluster.dir.exists()
    assert not (harness.RUN_DIR / f"{cluster.name}.json").exists()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [h.netns for h in hosts.hosts if h.netns in netns]
    cluster.close()  # idempotent


LEAVE_A_CLUSTER = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from netns_hosts import NamespaceHosts
import slurm_cluster
from slurm_cluster import SlurmCluster
cluster = SlurmCluster(NamespaceHosts(1, prefix="left"))
job_id = cluster.sbatch("srun sleep 300\\n")
cluster.wait_state(job_id, {"RUNNING"}, timeout=30)
procs = {pid: slurm_cluster.start_time(pid) for pid in cluster.processes()}
print(json.dumps({"dir": str(cluster.dir), "procs": procs}), flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.long
def test_a_later_cluster_removes_what_a_killed_test_process_left(
    slurm_cluster: MakeCluster,
) -> None:
    reason = harness.ensure_installed() or unavailable_reason()
    if reason:
        pytest.skip(reason)
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", LEAVE_A_CLUSTER, tests], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9, done.stderr
    left = json.loads(done.stdout)
    procs = {int(pid): t for pid, t in left["procs"].items()}
    assert len(procs) >= 5  # munged, slurmctld, slurmscriptd, slurmd, slurmstepd, ...
    slurm_cluster(1)
    assert survivors(procs) == {}
    assert not Path(left["dir"]).exists()
