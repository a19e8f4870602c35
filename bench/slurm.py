"""A node lost under Slurm: trainguard inside the allocation against Slurm's own requeue.

The cluster is the tests' real Slurm (``tests/slurm_cluster.py``: Debian's slurmctld, one
slurmd per network-namespace host, a private munged), three nodes, brought up fresh for
every run (a node cut off stays DOWN or drained) and torn down by pid. The harness lives
with the tests: :mod:`bench.hosts` puts ``tests/`` on ``sys.path``, as for the hosts
scenario. It needs root, ``ip`` and Debian's Slurm packages (installed with apt-get when
missing, as the tests do); :func:`unavailable` says why not otherwise, and the scenario
is then skipped with that reason.

Both sides run ``bench/train.py`` as 2 nodes x 2 ranks, and the benchmark cuts the host of
the job's second node off (``NamespaceHosts.cut``: the host's link goes down; its
processes keep running, unheard) once step S completed (:func:`bench.hosts.cut_at_step`):

- ``trainguard``: ``trainguard run -f job.yaml`` in an sbatch script (``--nodes=3
  --no-kill``): the controller and node 0 on the batch node, node 1 and the spare on the
  other two through their own steps. The cut node's ``node-1`` is lost after
  ``nodeLostAfterSeconds`` (8 s across hosts), drained (``scontrol update ...
  state=drain``), and the spare takes its ranks; memory-tier checkpoints every 10 steps.
  Detection is the cut to the first ``NodeLost`` fault.
- ``baseline_requeue``: plain Slurm, the same script as ``srun torchrun`` in an sbatch
  script (``--nodes=2 --requeue``, no ``--no-kill``: Slurm's default), rank 0
  ``torch.save``-ing every 10 steps. When Slurm declares the node DOWN it kills the job
  and requeues it; the job runs again on the two nodes left and torchrun resumes from the
  checkpoint. Detection is the cut to Slurm's requeue (``Restarts=1``).

Both record when Slurm declared the cut node DOWN (``node_down_s``). The cluster runs with
:data:`slurm_conf.FAST` (SlurmdTimeout=10, cred_expire=10, ...), which makes Slurm's side
far faster than its defaults: :data:`SLURM_SETTINGS` is written into the results.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from bench.hosts import SpareJob, cut_at_step, with_load
from bench.hosts import unavailable as hosts_unavailable
from bench.recovery import FaultRecord, FaultSetup, Variant, from_steps, log_rules
from bench.runs import NNODES, NPROC_PER_NODE, REPO, TRAIN, TrainArgs, TrainguardRun
from bench.steps import StepRecord, read_steps
from netns_hosts import Host, NamespaceHosts
from slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed
from slurm_conf import CRED_EXPIRE, FAST, node_states
from trainguard.platform.local import MEMORY_ROOT

SLURM_NODES = 3  # the job's 2 nodes and one more (trainguard's spare; where Slurm requeues)
HANG_RULE_SECONDS = 30.0  # node 0 goes quiet while node 1 is cut off (as bench/hosts.py)
TORCHRUN_PORT = 29600  # + SLURM_RESTART_COUNT: each Slurm run of the baseline its own
POLL_SECONDS = 0.25  # scontrol polls after the cut
DONE_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"})
SLURM_SETTINGS: dict[str, str] = {**FAST, "cred_expire": str(CRED_EXPIRE)}
"""The test cluster's Slurm timers (tests/slurm_conf.py), recorded with the results."""
SLURM_DEFAULTS: dict[str, str] = {
    "SlurmdTimeout": "300",
    "MessageTimeout": "10",
    "KillWait": "30",
    "SchedulerParameters": "sched_interval=60,bf_interval=30",
    "cred_expire": "120",
}
"""slurm.conf's defaults for the same keys (Slurm 22.05's man page), for comparison."""
_JOINED_NODE_1 = re.compile(r"host (\S+) \(\S+\) joined as node-1 \(node\)")
_ENDED = re.compile(r"job \S+ (succeeded|failed|stopped)")


def unavailable() -> str | None:
    """Why a Slurm cluster of namespace hosts cannot be made here, or None."""
    return hosts_unavailable() or ensure_installed()


@contextlib.contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A fresh 3-node cluster for one run; everything started on it dies with it. Its job
    ids start at a random ``FirstJobId``: a fresh cluster's would start at 1 every run,
    and trainguard's job id (``<name>-slurm<id>``) names its memory tier, which a later
    run of the same id would restore from."""
    first = {"FirstJobId": str(1000 + secrets.randbelow(60_000_000))}
    with (
        NamespaceHosts(SLURM_NODES, prefix="node") as hosts,
        SlurmCluster(hosts, conf_extra=first) as cluster,
    ):
        yield cluster


@dataclass
class Watch:
    """What Slurm did after the cut: seconds from the cut to the node reading DOWN, to
    the job's first requeue and to its running again after it (None: not seen)."""

    node_down_s: float | None = None
    requeue_s: float | None = None
    rerun_s: float | None = None

    def detail(self) -> dict[str, Any]:
        return {k: None if v is None else round(v, 2) for k, v in vars(self).items()}


def watch_until(
    cluster: SlurmCluster,
    job_id: int,
    node: str,
    fault_at: float,
    done: Callable[[dict[str, str]], bool],
    timeout: float,
) -> tuple[Watch, bool]:
    """Poll ``scontrol`` after the cut until ``done(job record)``; what it saw, and
    whether ``done`` came within ``timeout``."""
    watch = Watch()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = cluster.job(job_id)
        now = time.time() - fault_at
        if watch.requeue_s is None and int(job.get("Restarts", "0") or 0) > 0:
            watch.requeue_s = now
        elif watch.requeue_s is not None and watch.rerun_s is None and job["JobState"] == "RUNNING":
            watch.rerun_s = now
        if watch.node_down_s is None and "DOWN" in node_states(cluster.node(node)["State"]):
            watch.node_down_s = time.time() - fault_at
        if done(job):
            return watch, True
        time.sleep(POLL_SECONDS)
    return watch, False


# -- trainguard in the allocation ------------------------------------------------


def slurm_job() -> SpareJob:
    """The trainguard side's job: 2 nodes and a spare, the hosts scenario's hang rule."""
    return SpareJob("bench-slurm", retries=3, log_rules=log_rules(HANG_RULE_SECONDS))


def trainguard_script(spec: Path, state: Path) -> str:
    """The batch script: ``trainguard run`` as docs/slurm.md shows it."""
    return (
        "#!/bin/sh\n"
        f"export TRAINGUARD_STATE_DIR={shlex.quote(str(state))} PYTHONUNBUFFERED=1\n"
        f"cd {shlex.quote(str(REPO))}\n"
        f"exec {shlex.quote(sys.executable)} -m trainguard.cli run -f {shlex.quote(str(spec))}\n"
    )


def trainguard_lost(setup: FaultSetup) -> FaultRecord:
    """``trainguard run`` in a 3-node allocation (``--no-kill``); node-1's host cut off at
    the step; the job is expected to go on on the spare and succeed."""
    run = TrainguardRun(setup.workdir, setup.args, slurm_job())  # its describe() and steps()
    run.workdir.mkdir(parents=True, exist_ok=True)
    spec = run.workdir / "job.yaml"
    spec.write_text(yaml.safe_dump(run.job.spec(run.args, run.out)))
    jobs: list[int] = []  # their memory tiers are removed once the cluster is gone
    try:
        with slurm_cluster() as cluster:
            script = trainguard_script(spec, run.workdir / "state")
            jobs.append(cluster.sbatch(script, f"--nodes={SLURM_NODES}", "--no-kill"))
            cut = _cut_node_1(cluster, jobs[0], run, setup)
            if isinstance(cut, FaultRecord):
                return cut
            host, fault_at = cut

            def ended(job: dict[str, str]) -> bool:
                out = cluster.output(jobs[0])
                return job["JobState"] in DONE_STATES or bool(_ENDED.search(out))

            watch, finished = watch_until(
                cluster, jobs[0], host.name, fault_at, ended, setup.timeout
            )
            reason = cluster.node(host.name).get("Reason", "")
            _save_output(cluster, jobs[0], run.workdir)
    finally:
        for job_id in jobs:
            shutil.rmtree(MEMORY_ROOT / f"{run.job.name}-slurm{job_id}", ignore_errors=True)
    job = run.describe()
    lost = [f["detected_at"] for f in job["faults"] if f["type"] == "NodeLost"]
    detect = min(lost) - fault_at if lost else None
    ok = finished and job["phase"] == "Succeeded"
    note = "" if ok else f"job {job['phase']}: {job['reason']}"
    if job["faults"] and job["faults"][0]["type"] != "NodeLost":
        note = (note + "; " if note else "") + f"the first fault was {job['faults'][0]['type']}"
    record = from_steps(run.steps(), fault_at, detect, note)
    restarted = [e["time"] - fault_at for e in job["events"]
                 if e["kind"] == "AttemptStarted" and e["time"] > fault_at]  # fmt: skip
    detail = {
        **watch.detail(),
        "attempt_started_s": round(min(restarted), 2) if restarted else None,
        "drained": "trainguard" in reason,
        "node_reason": reason,
    }
    return replace(record, detail=detail)


def _cut_node_1(
    cluster: SlurmCluster, job_id: int, run: TrainguardRun, setup: FaultSetup
) -> tuple[Host, float] | FaultRecord:
    """Cut the host of the job's node-1 off once the step completed: the host and the
    time just before the cut, or the record of a run where that never came."""
    host = _node_1_host(cluster, job_id, setup.timeout)
    if host is None:
        return FaultRecord(False, note=f"node-1 never joined: {_tail(cluster, job_id)}")
    fault_at = cut_at_step(run.steps, cluster.hosts, host, setup.step, setup.timeout)
    if fault_at is None:
        _save_output(cluster, job_id, run.workdir)
        return FaultRecord(False, note=f"step {setup.step} never reached")
    return host, fault_at


def _node_1_host(cluster: SlurmCluster, job_id: int, timeout: float) -> Host | None:
    """The namespace host the job's node-1 joined from (its batch output says)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _JOINED_NODE_1.search(cluster.output(job_id))
        if found:
            return next(h for h in cluster.hosts.hosts if h.name == found.group(1))
        if cluster.job(job_id)["JobState"] in DONE_STATES:
            return None
        time.sleep(POLL_SECONDS)
    return None


# -- plain Slurm: srun torchrun, requeued ----------------------------------------------


def torchrun_script(
    args: TrainArgs, out: Path, ckpt: Path, ifname: str, python: str = sys.executable
) -> str:
    """The baseline's batch script: ``srun`` starts one torchrun per node (static
    rendezvous at the job's first node, its node rank ``SLURM_NODEID``); each Slurm run
    of the job (``SLURM_RESTART_COUNT``) is its own torchrun run id and port."""
    torchrun = [
        python, "-m", "torch.distributed.run", "--nnodes", str(NNODES),
        "--nproc-per-node", str(NPROC_PER_NODE), "--max-restarts", "0",
    ]  # fmt: skip
    train = [str(TRAIN), *args.argv(out, "torch"), "--ckpt-dir", str(ckpt)]
    task = 'PET_NODE_RANK="$SLURM_NODEID" exec "$@"'  # torchrun reads PET_<FLAG>
    return (
        "#!/bin/sh\n"
        f"export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME={shlex.quote(ifname)}\n"
        f"cd {shlex.quote(str(REPO))}\n"
        'MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f"PORT=$(({TORCHRUN_PORT} + ${{SLURM_RESTART_COUNT:-0}}))\n"
        'RUN="slurm${SLURM_JOB_ID}r${SLURM_RESTART_COUNT:-0}"\n'
        f"exec srun --nodes={NNODES} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"sh -c {shlex.quote(task)} sh {shlex.join(torchrun)} "
        '--master-addr "$MASTER" --master-port "$PORT" --rdzv-id "$RUN" '
        f"{shlex.join(train)}\n"
    )


def requeue_lost(setup: FaultSetup) -> FaultRecord:
    """``srun torchrun`` in a 2-node batch job (``--requeue``, Slurm's default kill on a
    node failure); the job's second node's host cut off at the step; Slurm requeues the
    job and it resumes from rank 0's ``torch.save``."""
    workdir = setup.workdir
    out, ckpt = workdir / "out", workdir / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)

    def steps() -> list[StepRecord]:
        return read_steps(out / "steps.txt")

    with slurm_cluster() as cluster:
        script = torchrun_script(setup.args, out, ckpt, cluster.hosts[0].ifname)
        job_id = cluster.sbatch(script, f"--nodes={NNODES}", "--requeue")
        cluster.wait_state(job_id, {"RUNNING"}, setup.timeout)
        nodes = cluster.scontrol("show", "hostnames", cluster.job(job_id)["NodeList"]).split()
        host = next(h for h in cluster.hosts.hosts if h.name == nodes[-1])
        fault_at = cut_at_step(steps, cluster.hosts, host, setup.step, setup.timeout)
        if fault_at is None:
            _save_output(cluster, job_id, workdir)
            return FaultRecord(False, note=f"step {setup.step} never reached")

        def ended(job: dict[str, str]) -> bool:
            return job["JobState"] in DONE_STATES

        watch, finished = watch_until(cluster, job_id, host.name, fault_at, ended, setup.timeout)
        record = cluster.job(job_id)
        _save_output(cluster, job_id, workdir)
    ok = finished and record["JobState"] == "COMPLETED"
    note = "" if ok else f"Slurm job {record['JobState']} (Restarts={record.get('Restarts')})"
    result = from_steps(steps(), fault_at, watch.requeue_s, note)
    return replace(result, detail={**watch.detail(), "restarts": record.get("Restarts")})


def _save_output(cluster: SlurmCluster, job_id: int, workdir: Path) -> None:
    """Keep the job's output (the cluster's directory goes with it)."""
    with contextlib.suppress(OSError):
        (workdir / f"slurm-{job_id}.out").write_text(cluster.output(job_id))


def _tail(cluster: SlurmCluster, job_id: int) -> str:
    return " / ".join(cluster.output(job_id).strip().splitlines()[-3:])[-300:]


def guarded(variant: Variant) -> Variant:
    """``variant`` with the load average noted, and a cluster that would not start
    recorded as a run that did not recover (with why) rather than ending the benchmark."""
    loaded = with_load(variant)

    def run(setup: FaultSetup) -> FaultRecord:
        try:
            return loaded(setup)
        except (SlurmUnavailable, AssertionError, RuntimeError) as exc:
            return FaultRecord(False, note=f"{type(exc).__name__}: {str(exc)[:300]}")

    return run


SLURM_LOST_VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", guarded(trainguard_lost)),
    ("baseline_requeue", guarded(requeue_lost)),
]
