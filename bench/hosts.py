"""One job on several hosts: a rank SIGKILLed on another host, and a host cut off.

The hosts are network namespaces on one bridge (``tests/netns_hosts.py``: each has its
own address, hostname and hosts file; the filesystem is this machine's, so the step
records, the spec and ``torch.save``'s checkpoint are shared as on the one-host sides).
The harness lives with the tests: ``tests/`` is put on ``sys.path`` below rather than
copying it here. It needs root and ``ip``; :func:`unavailable` says why not otherwise,
and the scenario is then skipped with that reason.

Every variant is a :data:`bench.recovery.Variant` (a :class:`FaultSetup` in, a
:class:`FaultRecord` out, figures from the step records by :func:`from_steps`), so the
stall, the steps lost and the detection mean what they mean in the recovery scenario.

- trainguard: the same ``trainguard run -f job.yaml --rdzv-endpoint HOST0:PORT`` on
  three hosts, in join order: host 0 (controller, node 0), host 1 (node 1: ranks 2 and
  3), host 2 (the spec's one spare: its agent is started as a standby when it joins, its
  worker template warm, and idle until a node is lost). SIGKILL:
  ``--inject kill:rank=3@step=S``, a process-level restart. Cut off:
  ``--inject partition:node=1@step=S`` (host 1's daemon takes its interface down for
  good); its node is lost after ``nodeLostAfterSeconds`` (8 s across hosts) and the job
  restarts with host 2 in its place. Detection is the injection to the first
  ``NodeLost`` fault (:func:`lost_detection`).
- ``baseline_one_host``: the same job spec on one machine (2 local nodes and a spare),
  the same SIGKILL, and for the cut ``--inject node-kill:node=1@step=S`` (its agent and
  workers SIGKILLed: the closest fault one host has).
- ``baseline_relaunch``: torchrun on hosts 0 and 1 (static rendezvous:
  ``--nnodes 2 --node-rank K --master-addr HOST0 --master-port P``, ``GLOO_SOCKET_IFNAME``
  the hosts' interface), the benchmark SIGKILLing rank 3 at the step; a relaunch is a
  scheduler's: once one torchrun has failed, every torchrun is SIGKILLed and all are
  started again, resuming from rank 0's ``torch.save``.
- ``baseline_relaunch_at_cut``: the benchmark cuts host 1 off (``NamespaceHosts.cut``) at
  the step and at once kills every torchrun and relaunches on hosts 0 and 2: a
  scheduler told of the cut the moment it happens (no detection time; a lower bound for
  any relaunch).
- ``baseline_torchrun``: the same cut, with only torchrun's own detection: a relaunch
  (on hosts 0 and 2) follows once one of its torchruns exits. It gets ``cap`` seconds.

Hit times: trainguard's are its ``FaultInjected`` events (taken just before the
controller asks the agent or the host daemon to act, so a few ms early); the
baselines' are the benchmark's, just before it signals or cuts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from bench.baseline import POLL_SECONDS, Relaunch, signal_at_step
from bench.recovery import (
    FAULTY_RANK,
    FaultRecord,
    FaultSetup,
    Variant,
    from_steps,
    log_rules,
    trainguard_fault,
)
from bench.runs import (
    NNODES,
    NPROC_PER_NODE,
    REPO,
    TRAIN,
    TorchrunRun,
    TrainArgs,
    TrainguardJob,
    TrainguardRun,
    process_tree,
)
from bench.steps import StepRecord, recovery_after

TESTS = REPO / "tests"
if str(TESTS) not in sys.path:  # the namespace-hosts harness is the tests' (not copied)
    sys.path.insert(0, str(TESTS))

from netns_hosts import Host, NamespaceHosts, NetnsUnavailable, unavailable_reason  # noqa: E402

HOSTS = 3  # node 0, node 1, the spare
CUT_NODE = 1  # node 1, host 1: ranks 2 and 3 (FAULTY_RANK runs there)
ENDPOINT_PORT = 29500  # on host 0: trainguard's controller
TORCHRUN_PORT = 29600  # on host 0: the static rendezvous of launch i is this + i
TOKEN = "trainguard-bench-hosts-token-0123456789"  # $TRAINGUARD_TOKEN (16+ characters)
HANG_RULE_SECONDS = 30.0
"""The jobs' hang rule here. Node 0's log goes quiet while host 1 is cut off; with the
recovery scenario's 5 s rule node 0 would be found hung before node 1 is found lost (8 s).
"""
JOIN_WAIT = 60.0  # host 1 must have joined (as node 1) before the spare host starts
LINGER = 15.0  # the other hosts' `trainguard run` exit after the controller's (a lease)


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (tried: one is made and removed), or None."""
    why = unavailable_reason()
    if why is not None:
        return why
    try:
        NamespaceHosts(1, prefix="probe").close()
    except (NetnsUnavailable, RuntimeError) as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def namespace_hosts() -> Iterator[NamespaceHosts]:
    """Three fresh hosts for one run; everything started on them dies with them."""
    with NamespaceHosts(HOSTS, prefix="host") as hosts:
        yield hosts


@dataclass(frozen=True)
class SpareJob(TrainguardJob):
    """A benchmark job with spare nodes in its one replica group."""

    spares: int = 1

    def spec(self, args: TrainArgs, out: Path) -> dict[str, Any]:
        job = super().spec(args, out)
        job["spec"]["replicaSpecs"][0]["spares"] = self.spares
        return job


def hosts_job() -> SpareJob:
    """The job of every trainguard side here, on hosts and on one host alike."""
    return SpareJob("bench-hosts", retries=3, log_rules=log_rules(HANG_RULE_SECONDS))


# -- trainguard on the hosts ----------------------------------------------------


class HostsTrainguardRun(TrainguardRun):
    """``trainguard run -f job.yaml --rdzv-endpoint HOST0:PORT`` on each host, in join
    order; host 0's state directory is this run's ``state`` (so :meth:`describe` reads
    the controller's), the others' ``state-<host>``."""

    def __init__(
        self, hosts: NamespaceHosts, workdir: Path, args: TrainArgs, job: TrainguardJob
    ) -> None:
        super().__init__(workdir, args, job)
        self.hosts = hosts

    def start(self, injections: Sequence[str] = ()) -> None:
        spec = self.workdir / "job.yaml"
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec.write_text(yaml.safe_dump(self.job.spec(self.args, self.out)))
        argv = [sys.executable, "-m", "trainguard.cli", "run", "-f", str(spec),
                "--rdzv-endpoint", f"{self.hosts[0].addr}:{ENDPOINT_PORT}",
                "--join-timeout", f"{JOIN_WAIT:g}"]  # fmt: skip
        injected = [arg for injection in injections for arg in ("--inject", injection)]
        self.launched_at = time.time()
        self._spawn_on(self.hosts[0], [*argv, *injected], self.workdir / "state")
        member = self._spawn_on(self.hosts[1], argv, self.workdir / "state-host1")
        deadline = time.monotonic() + JOIN_WAIT
        while "joined job" not in member.read_text(errors="replace"):
            if time.monotonic() > deadline or self.procs[1].poll() is not None:
                raise RuntimeError(f"host 1 did not join within {JOIN_WAIT:g} s: see {member}")
            time.sleep(POLL_SECONDS)
        self._spawn_on(self.hosts[2], argv, self.workdir / "state-host2")  # the spare

    def wait(self, timeout: float) -> bool:
        """True when the controller's ``trainguard run`` exited within ``timeout``; the
        other hosts then get :data:`LINGER` seconds (a host cut off for good never hears
        the end; :meth:`stop` ends it)."""
        try:
            self.procs[0].wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        deadline = time.monotonic() + LINGER
        for proc in self.procs[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        return True

    def _spawn_on(self, host: Host, argv: Sequence[str], state: Path) -> Path:
        log = self.workdir / f"{host.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAINGUARD_STATE_DIR": str(state),
               "TRAINGUARD_TOKEN": TOKEN, "TRAINGUARD_ALLOW_PARTITION": "1"}  # fmt: skip
        with open(log, "ab") as out:
            self.procs.append(
                self.hosts.popen(
                    host, argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
                )
            )
        return log


def lost_detection(job: dict[str, Any]) -> float | None:
    """Seconds from the job's first ``FaultInjected`` event to its first ``NodeLost``
    fault (``trainguard describe -o json``); None when either is missing."""
    injected = [e["time"] for e in job["events"] if e["kind"] == "FaultInjected"]
    lost = [f["detected_at"] for f in job["faults"] if f["type"] == "NodeLost"]
    if not injected or not lost:
        return None
    return float(min(lost)) - float(min(injected))


def trainguard_kill(setup: FaultSetup) -> FaultRecord:
    """``--inject kill:rank=3@step=S`` on the hosts: rank 3 runs on host 1."""
    return _trainguard_hosts(setup, f"kill:rank={FAULTY_RANK}@step={setup.step}")


def trainguard_cut(setup: FaultSetup) -> FaultRecord:
    """``--inject partition:node=1@step=S``: host 1 cut off for good; detection is the
    cut to ``NodeLost``."""
    return _trainguard_hosts(setup, f"partition:node={CUT_NODE}@step={setup.step}", lost=True)


def _trainguard_hosts(setup: FaultSetup, injection: str, lost: bool = False) -> FaultRecord:
    with namespace_hosts() as hosts:
        run = HostsTrainguardRun(hosts, setup.workdir, setup.args, hosts_job())
        try:  # trainguard_fault stops the run, however it ends
            record = trainguard_fault(run, injection, setup.timeout)
        except RuntimeError as exc:  # a host that did not join, a describe that failed
            return FaultRecord(False, note=f"trainguard on hosts: {exc}")
        if lost:
            job = run.describe()
            first = job["faults"][0]["type"] if job["faults"] else None
            note = record.note
            if first not in (None, "NodeLost"):
                note = (note + "; " if note else "") + f"the first fault was {first}"
            spare_log = (setup.workdir / f"{hosts[2].name}.log").read_text(errors="replace")
            warm = WARM_SPARE_LINE in spare_log
            if not warm:
                note = (note + "; " if note else "") + "the spare host's agent was not warm"
            detail = {**record.detail, "spare_warm": warm, "after_lost": after_lost(job)}
            record = replace(record, detect_s=lost_detection(job), note=note, detail=detail)
    return record


WARM_SPARE_LINE = "this spare host's agent is up"  # hosts/daemon.py, once its standby serves


def after_lost(job: dict[str, Any]) -> dict[str, float]:
    """Where the time from the first ``NodeLost`` fault to the recovery went, in seconds
    (``trainguard describe -o json``'s events): ``stop`` (the faulted attempt stopped),
    ``launch`` (the next attempt's agents up, the spare's among them), ``start`` (its
    ranks' first step: the ``Recovered`` event). A part whose events are missing is left out."""
    lost = [f["detected_at"] for f in job["faults"] if f["type"] == "NodeLost"]
    if not lost:
        return {}
    marks = [("stop", "AttemptEnded"), ("launch", "AttemptStarted"), ("start", "Recovered")]
    parts: dict[str, float] = {}
    at = float(min(lost))
    for name, kind in marks:
        times = [float(e["time"]) for e in job["events"] if e["kind"] == kind and e["time"] >= at]
        if not times:
            break
        parts[name] = round(min(times) - at, 3)
        at = min(times)
    return parts


def one_host_kill(setup: FaultSetup) -> FaultRecord:
    """The same job and SIGKILL on one machine."""
    run = TrainguardRun(setup.workdir, setup.args, hosts_job())
    return trainguard_fault(run, f"kill:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


def one_host_node_kill(setup: FaultSetup) -> FaultRecord:
    """The same job on one machine, ``--inject node-kill:node=1@step=S``."""
    run = TrainguardRun(setup.workdir, setup.args, hosts_job())
    return trainguard_fault(run, f"node-kill:node={CUT_NODE}@step={setup.step}", setup.timeout)


# -- torchrun on the hosts ------------------------------------------------------


def torchrun_argv(
    master: str, node_rank: int, port: int, run_id: str, args: TrainArgs, out: Path, ckpt: Path
) -> list[str]:
    """torchrun's static form for one host of a 2-host job (rank 0 ``torch.save``s)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NNODES),
            "--nproc-per-node", str(NPROC_PER_NODE), "--node-rank", str(node_rank),
            "--master-addr", master, "--master-port", str(port), "--rdzv-id", run_id,
            "--max-restarts", "0", str(TRAIN), *args.argv(out, "torch"),
            "--ckpt-dir", str(ckpt)]  # fmt: skip


class HostsTorchrunRun(TorchrunRun):
    """One launch: a torchrun on each host of ``placement``, meeting at the first's.

    It is over once every torchrun exited, or once one failed: the others are then
    SIGKILLed, as a scheduler tears down a job whose task failed."""

    def __init__(
        self,
        hosts: NamespaceHosts,
        placement: Sequence[Host],
        workdir: Path,
        args: TrainArgs,
        run_id: str,
    ) -> None:
        super().__init__(workdir, args, run_id)
        self.hosts = hosts
        self.placement = list(placement)

    def start(self, port: int) -> None:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.launched_at = time.time()
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": self.placement[0].ifname,
        }
        for rank, host in enumerate(self.placement):
            argv = torchrun_argv(
                self.placement[0].addr, rank, port, self.run_id, self.args, self.out, self.ckpt_dir
            )
            with open(self.workdir / f"{self.run_id}-{host.name}.log", "ab") as log:
                self.procs.append(
                    self.hosts.popen(
                        host, argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
                    )
                )

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            codes = self.returncodes
            if all(code is not None for code in codes):
                return True
            if any(code not in (None, 0) for code in codes):
                self.kill()
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_SECONDS)

    def kill(self) -> None:
        """SIGKILL every process of this launch (its workers lead their own sessions)."""
        tree = [proc for p in self.procs if p.poll() is None for proc in process_tree(p.pid)]
        for proc in tree:
            proc.signal(signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10.0)


class HostsRelaunch(Relaunch):
    """:class:`Relaunch` across namespace hosts: each launch on :attr:`placement`."""

    def __init__(self, hosts: NamespaceHosts, workdir: Path, args: TrainArgs) -> None:
        super().__init__(workdir, args, max_launches=3)
        self.hosts = hosts
        self.placement: list[Host] = [hosts[0], hosts[1]]

    def move(self, placement: Sequence[Host], kill: bool) -> None:
        """Launch on ``placement`` from now on; ``kill``: end the current launch now."""
        with self._lock:
            self.placement = list(placement)
            current = self.runs[-1]
        if kill:
            current.kill()  # type: ignore[attr-defined]  # always a HostsTorchrunRun

    def _launch(self) -> None:
        with self._lock:  # never after stop() took the current run
            if self._stopping.is_set():
                return
            index = len(self.runs)
            run = HostsTorchrunRun(
                self.hosts, self.placement, self.workdir, self.args, f"relaunch{index}"
            )
            self.runs.append(run)
            run.start(TORCHRUN_PORT + index)


@contextlib.contextmanager
def torchrun_on_hosts(setup: FaultSetup) -> Iterator[tuple[NamespaceHosts, HostsRelaunch]]:
    """Fresh hosts, and torchrun launched on hosts 0 and 1; stopped however it ends."""
    with namespace_hosts() as hosts:
        relaunch = HostsRelaunch(hosts, setup.workdir, setup.args)
        try:
            relaunch.start()
            yield hosts, relaunch
        finally:
            relaunch.stop()


def relaunch_kill(setup: FaultSetup) -> FaultRecord:
    """SIGKILL of rank 3 (host 1) under torchrun across hosts; relaunched after it fails."""
    with torchrun_on_hosts(setup) as (_, relaunch):
        kill = (FAULTY_RANK, setup.step, signal.SIGKILL, setup.timeout)
        fault_at = signal_at_step(relaunch.steps, relaunch.rank_process, *kill)
        relaunch.wait(setup.timeout)
    return _relaunch_record(relaunch, fault_at, detected=True)


def relaunch_at_cut(setup: FaultSetup) -> FaultRecord:
    """Host 1 cut off at the step; every torchrun killed at once and relaunched on hosts
    0 and 2 (a scheduler told of the cut as it happens: no detection time)."""
    return _torchrun_cut(setup, told=True)


def torchrun_cut(setup: FaultSetup) -> FaultRecord:
    """Host 1 cut off at the step, torchrun left to notice: a relaunch (on hosts 0 and 2)
    follows once one of its torchruns exits. Capped at ``cap`` seconds after the cut."""
    return _torchrun_cut(setup, told=False)


def _torchrun_cut(setup: FaultSetup, told: bool) -> FaultRecord:
    with torchrun_on_hosts(setup) as (hosts, relaunch):
        fault_at = cut_at_step(relaunch.steps, hosts, hosts[CUT_NODE], setup.step, setup.timeout)
        if fault_at is not None:
            relaunch.move([hosts[0], hosts[2]], kill=told)
            until = fault_at + (0.0 if told else setup.cap)  # told: relaunch.wait below
            while time.time() < until and not _recovered(relaunch, fault_at):
                time.sleep(POLL_SECONDS * 4)
        relaunch.wait(setup.timeout if told or _recovered(relaunch, fault_at) else 0.0)
    record = _relaunch_record(relaunch, fault_at, detected=not told)
    if told or record.recovered or fault_at is None:
        return record
    exited = "no torchrun exited" if record.detect_s is None else "a torchrun exited"
    note = f"> {setup.cap:g} s: no step after the cut within the cap ({exited})"
    return replace(record, note=note, detail={"cap_s": setup.cap})


def _recovered(relaunch: HostsRelaunch, fault_at: float | None) -> bool:
    return fault_at is not None and recovery_after(relaunch.steps(), fault_at) is not None


def cut_at_step(
    steps: Callable[[], Sequence[StepRecord]],
    hosts: NamespaceHosts,
    host: Host,
    step: int,
    timeout: float,
) -> float | None:
    """Cut ``host`` off once step ``step`` completed; the time just before, None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = steps()
        if records and max(r.step for r in records) >= step:
            at = time.time()
            hosts.cut(host)
            return at
        time.sleep(POLL_SECONDS)
    return None


def _relaunch_record(
    relaunch: HostsRelaunch, fault_at: float | None, detected: bool
) -> FaultRecord:
    """The record of a relaunched run; ``detected``: its detection is the first failed
    launch's end after the fault (else there is none to measure)."""
    exits = [t for t in relaunch.exits if fault_at is not None and t >= fault_at]
    detect = exits[0] - fault_at if detected and exits and fault_at is not None else None
    note = "" if relaunch.succeeded else "the relaunched job did not complete"
    if not relaunch.succeeded:
        why = _first_error(relaunch.log_text())
        note += f": {why}" if why else ""
    return from_steps(relaunch.steps(), fault_at, detect, note)


def _first_error(text: str) -> str | None:
    for line in text.splitlines():
        if "Error" in line or "error:" in line:
            return line.strip()[:300]
    return None


def with_load(variant: Variant) -> Variant:
    """``variant``, its record's ``detail`` noting the 1-minute load average as it ended
    (about the run's own: every run here lasts a minute or so)."""

    def run(setup: FaultSetup) -> FaultRecord:
        record = variant(setup)
        return replace(record, detail={**record.detail, "load_1m": round(os.getloadavg()[0], 2)})

    return run


HOSTS_KILL_VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", with_load(trainguard_kill)),
    ("baseline_one_host", with_load(one_host_kill)),
    ("baseline_relaunch", with_load(relaunch_kill)),
]
HOSTS_CUT_VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", with_load(trainguard_cut)),
    ("baseline_one_host", with_load(one_host_node_kill)),
    ("baseline_relaunch_at_cut", with_load(relaunch_at_cut)),
    ("baseline_torchrun", with_load(torchrun_cut)),
]
