"""A real Slurm cluster for tests: one slurmd per namespace host (tests/netns_hosts.py).

Debian's slurm-wlm 22.05 with munge; slurm.conf and the readers of ``scontrol`` output are
pure functions in tests/slurm_conf.py. :class:`SlurmCluster` starts, each in the foreground
and by this process (so each pid is the daemon's own):

- a private ``munged`` on the machine (its own random key, socket, pid and seed files);
  daemons and clients find its socket through ``AuthInfo=socket=...`` in slurm.conf (a
  filesystem socket works across network namespaces, and the hosts share the filesystem);
- ``slurmctld`` on the machine, ``SlurmctldHost=<this machine's hostname>(<bridge addr>)``,
  on a free TCP port (two clusters on one machine, e.g. two xdist workers, never share one);
- one ``slurmd -N <host name>`` per namespace host, through :meth:`NamespaceHosts.popen`
  (``nsenter`` keeps ``/sys/fs/cgroup``; under ``ip netns exec`` slurmd 22.05 refuses to
  start: "Unable to initialize cgroup plugin"), ``NodeAddr=<its address>``.

Everything else lives in a private directory, ``/run/trainguard-slurm/<name>/``: slurm.conf,
munge key and socket, controller state, each node's spool, logs (``log/``), the jobs'
scripts and output (``jobs/``). Nothing is written to /etc: the clients find the cluster
through :attr:`SlurmCluster.env` (``SLURM_CONF``). Installing the packages
(:func:`ensure_installed`) is the only change made to the machine itself.

Where the clients work: with :attr:`SlurmCluster.env`, ``sbatch``, ``srun``, ``scontrol``,
``squeue``, ``sinfo`` and ``scancel`` work from the machine and from inside a host
(:meth:`SlurmCluster.command` does both); a job's own ``srun`` runs on the job's nodes.

Identifying the cluster's processes: the daemons by the pids this process started; what
they start by a marker in its environment, ``TRAINGUARD_SLURM_CLUSTER=<private dir>``:
slurmctld's ``slurmscriptd`` and every ``slurmstepd`` inherit it from their daemon
(slurmstepd runs detached: parent 1, a session of its own), a job's processes from
:attr:`SlurmCluster.env` (sbatch exports the submitter's environment).
:meth:`SlurmCluster.close` SIGKILLs the daemons by pid (controller, nodes, munged last),
then every process with the marker until none is left, then removes the directory. A
record in ``/run/trainguard-slurm/`` lets a later cluster remove what a test process that
died left behind (as netns_hosts does).

Measured on a 2-core gVisor VM, shared with other test runs (Debian 12, slurm-wlm 22.05.8,
munge 0.5.15, :data:`slurm_conf.FAST`):

- installing the four packages (``--no-install-recommends``): 49 s, once per machine;
- 3 namespace hosts 0.3 s, then the cluster (munged to every node idle) 0.6-1.3 s;
  :meth:`SlurmCluster.close` (daemons, steps, directory) 0.1-0.3 s;
- ``srun -N2 hostname`` from the machine or a host 0.3-0.4 s; a batch job of it, submitted
  to COMPLETED, 1.2-1.4 s;
- a cut-off host's node: ``MIXED+NOT_RESPONDING`` after ~12 s, ``DOWN+NOT_RESPONDING``
  (sinfo's ``down*``, Reason "Not responding") 12-20 s after the cut; back to IDLE ~40 s
  after :meth:`NamespaceHosts.restore`;
- ``scontrol requeue`` of a running job: its task runs again, ``Restarts=1``, 11 s later;
- ``scancel``: CANCELLED, and every process of the job gone, in 0.4 s;
- drain and resume: at once (``IDLE+DRAIN`` with the reason, then ``IDLE``);
- tests/test_slurm_cluster.py: 45-65 s alone, 40-60 s on two xdist workers.

What a lost node does to a job (``sbatch --no-kill``, node1 of node[0-1] cut off): when
node1 is DOWN the job stays RUNNING, its NodeList shrinks to ``node0``, and its batch
script runs on. A step across both nodes started with plain ``srun`` is force-terminated on
every node ("srun: Force Terminated StepId=..."); started with ``srun --no-kill`` its tasks
on node0 run on ("srun: error: Node failure on node1"). A task on the cut host itself keeps
running (the cut is the network only) and still writes to the shared filesystem.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from netns_hosts import Host, NamespaceHosts, locked
from slurm_conf import node_states, parse_record, slurm_conf
from trainguard.platform.procs import start_time

RUN_DIR = Path("/run/trainguard-slurm")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol")
MARKER = "TRAINGUARD_SLURM_CLUSTER"
INSTALL_TIMEOUT = 240.0  # under pytest's 300 s per test
START_TIMEOUT = 60.0  # munged's socket, then every node idle
COMMAND_TIMEOUT = 30.0  # one client command
KILL_TIMEOUT = 10.0
POLL_INTERVAL = 0.2
_counter = itertools.count()
_live: set[SlurmCluster] = set()  # closed at exit if a test did not


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or run here."""


def _marked_pids(directory: Path) -> list[int]:
    """Live processes whose environment carries ``MARKER=<directory>``."""
    want = f"{MARKER}={directory}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if want in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def _kill(pids: Mapping[int, str | None], directory: Path, timeout: float = KILL_TIMEOUT) -> None:
    """SIGKILL ``pids`` (pid -> start time; a pid since reused is spared), then every process
    marked with ``directory``, until none is left."""
    for pid, started in pids.items():
        if started is not None and start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while marked := _marked_pids(directory):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of the cluster left after {timeout:.0f}s: {marked}")
        for pid in marked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _sweep_stale() -> None:
    """Kill and remove what clusters of dead test processes left (caller holds the lock)."""
    for path in RUN_DIR.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if start_time(record["owner"]) != record["owner_start"]:
            with contextlib.suppress(RuntimeError):
                _kill({int(p): s for p, s in record["pids"].items()}, Path(record["dir"]))
                shutil.rmtree(record["dir"], ignore_errors=True)
                path.unlink(missing_ok=True)


def ensure_installed(timeout: float = INSTALL_TIMEOUT) -> str | None:
    """Install Debian's Slurm and munge (apt-get, as root) when a program is missing: why
    that cannot be done, or None when they are there. apt-get update only when the install
    fails without it; one install at a time on the machine (xdist workers wait)."""
    if all(shutil.which(p) for p in PROGRAMS):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root"
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    options = ["-q", "-o", f"DPkg::Lock::Timeout={timeout / 2:.0f}"]
    install = ["install", "-y", "--no-install-recommends", *PACKAGES]
    deadline = time.monotonic() + timeout
    with locked(RUN_DIR / "install.lock"):
        for args in (install, ["update"], install):
            if all(shutil.which(p) for p in PROGRAMS):  # installed meanwhile
                return None
            argv = ["apt-get", *options, *args]
            try:
                left = max(deadline - time.monotonic(), 1.0)
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=left)
            except subprocess.TimeoutExpired:
                return f"installing {' '.join(PACKAGES)} took over {timeout:.0f}s"
        if all(shutil.which(p) for p in PROGRAMS):
            return None
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return f"installing {' '.join(PACKAGES)} failed: {' / '.join(tail)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port: int = s.getsockname()[1]
        return port


class SlurmCluster:
    """A Slurm cluster whose nodes are ``hosts`` (all of them, one partition); a context
    manager. Returns once every node is idle; raises :class:`SlurmUnavailable` (having
    stopped what it started) when a daemon fails or the nodes are not idle in ``timeout``.
    """

    def __init__(
        self,
        hosts: NamespaceHosts,
        *,
        partition: str = "tg",
        cpus: int = 2,
        conf_extra: dict[str, str] | None = None,
        timeout: float = START_TIMEOUT,
    ) -> None:
        why = ensure_installed()
        if why:
            raise SlurmUnavailable(why)
        self.hosts = hosts
        self.partition = partition
        self._closed = False
        self._owner = os.getpid()
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # name -> daemon
        self._scripts = itertools.count()
        with locked(RUN_DIR / "lock"):
            _sweep_stale()
            self.name = f"tg{os.getpid()}-{next(_counter)}"
            self.dir = RUN_DIR / self.name
            self._record_path = RUN_DIR / f"{self.name}.json"
            self.dir.mkdir(mode=0o755)
            self._write_record()
            _live.add(self)
        self.conf_path = self.dir / "slurm.conf"
        self.log_dir = self.dir / "log"
        self.jobs_dir = self.dir / "jobs"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.env: dict[str, str] = {
            **clean,
            "SLURM_CONF": str(self.conf_path),
            MARKER: str(self.dir),
        }
        try:
            self._start(conf_extra, cpus, timeout)
        except BaseException:
            with contextlib.suppress(RuntimeError):
                self.close()
            raise

    def _write_record(self) -> None:
        pids = {p.pid: start_time(p.pid) for p in self._procs.values()}
        record = {"owner": self._owner, "owner_start": start_time(self._owner)}
        self._record_path.write_text(json.dumps({**record, "dir": str(self.dir), "pids": pids}))

    def _daemon(self, name: str, argv: list[str], host: Host | None = None) -> None:
        with open(self.log_dir / f"{name}.out", "wb") as out:
            kw: dict[str, Any] = {"env": self.env, "stdout": out, "stderr": subprocess.STDOUT}
            if host is None:
                proc = subprocess.Popen(argv, start_new_session=True, **kw)
            else:
                proc = self.hosts.popen(host, argv, **kw)
        self._procs[name] = proc
        self._write_record()

    def _start(self, conf_extra: dict[str, str] | None, cpus: int, timeout: float) -> None:
        for sub in ("munge", "state", "spool", "log", "jobs"):
            (self.dir / sub).mkdir(mode=0o755)
        for h in self.hosts.hosts:
            (self.dir / "spool" / h.name).mkdir(mode=0o755)
        key = self.dir / "munge" / "munge.key"
        key.touch(mode=0o600)
        key.write_bytes(os.urandom(1024))
        (self.dir / "plugstack.conf").write_text("")
        self.conf_path.write_text(
            slurm_conf(
                cluster_name=self.name.replace("-", "x"),
                controller=(socket.gethostname().split(".")[0], self.hosts.bridge_addr),
                port=_free_port(),
                directory=self.dir,
                nodes={h.name: h.addr for h in self.hosts.hosts},
                partition=self.partition,
                cpus=cpus,
                extra=conf_extra,
            )
        )
        deadline = time.monotonic() + timeout
        munge = self.dir / "munge"
        self._daemon(
            "munged",
            [
                *("munged", "-F", f"--key-file={key}", f"--socket={self.munge_socket}"),
                *(f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}"),
            ],
        )
        self._wait(self.munge_socket.exists, deadline, "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf_path)])
        for h in self.hosts.hosts:
            self._daemon(f"slurmd-{h.name}", ["slurmd", "-D", "-N", h.name], host=h)
        self._wait(self._all_idle, deadline, "every node idle")

    def _all_idle(self) -> bool:
        done = self.command("scontrol", "show", "node", "-o", check=False)
        nodes = [parse_record(line) for line in done.stdout.splitlines() if line.strip()]
        return len(nodes) == len(self.hosts) and all(
            node_states(n.get("State", "")) == {"IDLE"} for n in nodes
        )

    def _wait(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        while not ready():
            dead = [name for name, proc in self._procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else "timed out"
                raise SlurmUnavailable(f"waiting for {what}: {why}\n{self.logs()}")
            time.sleep(POLL_INTERVAL)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> dict[str, int]:
        """The daemons this cluster started: ``munged``, ``slurmctld``, ``slurmd-<host>``."""
        return {name: proc.pid for name, proc in self._procs.items()}

    def processes(self) -> list[int]:
        """The cluster's live processes: its daemons, and every process that carries its
        marker (slurmctld's slurmscriptd, slurmstepd, job tasks, clients run with
        :attr:`env`)."""
        daemons = [p.pid for p in self._procs.values() if p.poll() is None]
        return sorted(set(daemons) | set(_marked_pids(self.dir)))

    def logs(self, tail: int = 20) -> str:
        """The last ``tail`` lines of every log, for a failure's message: the daemons' log
        files, and what a daemon wrote to stderr when it has no log file (munged) or has
        exited (a failure before it opened its log file)."""
        parts = []
        for path in sorted(self.log_dir.glob("*")):
            proc = self._procs.get(path.stem)
            if path.suffix == ".out" and path.stem != "munged" and proc and proc.poll() is None:
                continue
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-tail:]
                parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def command(
        self, *argv: str, host: Host | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command (``scontrol``, ``squeue``, ...) against this cluster, on the
        machine or on ``host``; with ``check``, a failure raises with its stderr."""
        if host is None:
            done = subprocess.run(
                argv, env=self.env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT
            )
        else:
            done = self.hosts.run(host, argv, env=self.env, timeout=COMMAND_TIMEOUT)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def scontrol(self, *args: str) -> str:
        """``scontrol ARGS`` on the machine; its stdout."""
        return self.command("scontrol", *args).stdout

    def sbatch(self, script: str | Path, *args: str, host: Host | None = None) -> int:
        """Submit a batch job; its id. ``script`` is a file, or a str holding the script's
        text (a ``#!/bin/sh`` line is added when it has none). It runs in :attr:`jobs_dir`,
        its output in ``jobs/<id>.out`` (:meth:`output`) unless ``args`` say otherwise.
        Submitted from the machine, or from ``host``."""
        if isinstance(script, str):
            text = script if script.startswith("#!") else "#!/bin/sh\n" + script
            script = self.jobs_dir / f"script-{next(self._scripts)}.sh"
            script.write_text(text)
        where = [f"--chdir={self.jobs_dir}", f"--output={self.jobs_dir / '%j.out'}"]
        done = self.command("sbatch", "--parsable", *where, *args, str(script), host=host)
        return int(done.stdout.strip().split(";")[0])

    def output(self, job_id: int) -> str:
        """What job ``job_id`` wrote to its default output file so far ('' before any)."""
        path = self.jobs_dir / f"{job_id}.out"
        return path.read_text() if path.exists() else ""

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o``: JobState, NodeList, Restarts, Reason, ExitCode, ..."""
        return parse_record(self.scontrol("show", "job", "-o", str(job_id)))

    def wait_state(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Poll until the job's JobState is one of ``states``; its record. AssertionError
        with the last record after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job}")
            time.sleep(POLL_INTERVAL)
        return job

    def node(self, name: str) -> dict[str, str]:
        """``scontrol show node -o``: State, Reason, CPUTot, NodeAddr, ..."""
        return parse_record(self.scontrol("show", "node", "-o", name))

    def wait_node(
        self, name: str, ready: Callable[[set[str]], bool], timeout: float
    ) -> dict[str, str]:
        """Poll until ``ready(node_states(State))``; the node's record. AssertionError with
        the last record after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not ready(node_states((node := self.node(name))["State"])):
            if time.monotonic() > deadline:
                raise AssertionError(f"node {name} not ready after {timeout}s: {node}")
            time.sleep(POLL_INTERVAL)
        return node

    def close(self) -> None:
        """SIGKILL the daemons by pid, then every process marked as this cluster's (steps,
        tasks); remove the private directory. Idempotent; raises if a process stayed."""
        if self._closed or os.getpid() != self._owner:  # not in a forked child
            return
        self._closed = True
        _live.discard(self)
        order = ["slurmctld", *(n for n in self._procs if n.startswith("slurmd-")), "munged"]
        procs = [self._procs[n] for n in order if n in self._procs]
        pids = {p.pid: start_time(p.pid) if p.poll() is None else None for p in procs}
        try:
            _kill(pids, self.dir)
        finally:
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=KILL_TIMEOUT)
        shutil.rmtree(self.dir, ignore_errors=True)
        self._record_path.unlink(missing_ok=True)


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.close()


@contextlib.contextmanager
def factory(
    make_hosts: Callable[..., NamespaceHosts],
) -> Iterator[Callable[..., SlurmCluster]]:
    """``make(nodes=3, *, prefix=None, **cluster_kw)``: namespace hosts from ``make_hosts``
    and a cluster on them. Skips the test when Slurm cannot be installed (not root, apt-get
    failed); closes every cluster made, however the test ends (the hosts are
    ``make_hosts``'s to close, after this)."""
    made: list[SlurmCluster] = []

    def make(nodes: int = 3, *, prefix: str | None = None, **kw: Any) -> SlurmCluster:
        why = ensure_installed()
        if why:
            pytest.skip(f"Slurm unavailable: {why}")
        cluster = SlurmCluster(make_hosts(nodes, prefix=prefix), **kw)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        errors = []
        for cluster in made:
            try:
                cluster.close()
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("; ".join(errors))
