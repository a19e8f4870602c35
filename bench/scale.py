"""Control-plane scale: the local platform's runner and controller driving N simulated nodes.

    python -m bench.scale --nodes 1024 --workdir DIR --out scale-1024.json

The real :class:`~trainguard.platform.local.LocalRunner` runs one job of N nodes x 8
ranks: the drive loop, the :class:`~trainguard.control.controller.JobController`, the
SQLite store, the transport's poller and concurrent sends, the inbox agents push to.
Only the agents are simulated, through the public seam: ``runner.launcher`` is a
:class:`FleetLauncher`, whose nodes are served by a few :mod:`bench.fleet` processes
(the real agent API over aiohttp, see there). Once every node got its ``/start`` and a
few full status poll cycles went by, one worker of the middle node dies; its node
pushes that to the controller, which stops every node; the job fails (no retries).

From the job's events (the controller's clock) and what the fleets saw (same machine):

- ``start_s``: the controller assigns ranks (``AttemptStarted``) -> the last node got
  ``/start``;
- ``detect_s``: the worker died -> the controller's ``Fault`` event (stamped with the
  time the deciding loop turn began, before it read the reports: it may even precede
  the failure by a little);
- ``push_s``: the worker died -> the controller accepted the node's push;
- ``first_stop_s``: the worker died -> the first node got ``/stop`` (the decision is
  made at the end of the loop turn that ``detect_s`` stamps with its start, so this
  bounds the decision from above);
- ``stop_s``: the worker died -> the last node got ``/stop``;
- ``stop_broadcast_s``: the first node got ``/stop`` -> the last one did;
- ``stopped_seen_s``: the first ``/stop`` -> the job ended (every node seen stopped);
- ``poll_cycle_s``: the median duration of a full status poll cycle of every node while
  the job runs (``transport.cycle_seconds``, between the start and the fault);
- ``launch_s``: the nodes launched (``NodesLaunching``) -> ``AttemptStarted`` (fleets
  come up, every node located and polled once);
- ``controller_rss_mib``: the runner's process, peak resident memory over what it had
  before the job (``controller_rss_peak_mib``: the peak itself;
  ``controller_rss_running_mib``: what it held while every node ran, just before the
  fault); ``controller_cpu_s``: its CPU time during the job; ``controller_fds``: its
  open files while the job runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from bench.fleet import PUSH_MODES, raise_open_files_limit
from bench.runs import REPO
from trainguard.agent.client import AgentClient, AgentError
from trainguard.control.events import Event
from trainguard.health.suite import Peers
from trainguard.platform.local import LocalRunner
from trainguard.platform.store import Store
from trainguard.spec import TrainingJob, resolve_plan

FLEETS = 2
NPROC_PER_NODE = 8
SETTLE_CYCLES = 3
"""Full poll cycles to let go by between the last ``/start`` and the fault."""
FLEET_EXIT_TIMEOUT = 30.0
PORTS_RECHECK_SECONDS = 0.05


class FleetProcess:
    """One :mod:`bench.fleet` process and the ports it announced."""

    def __init__(self, process: subprocess.Popen[bytes], ports_file: Path, record: Path):
        self.process = process
        self.ports_file = ports_file
        self.record = record
        self._ports: dict[str, int] | None = None
        self._checked = 0.0

    def ports(self) -> dict[str, int]:
        """Every node's port once the fleet serves them all (empty before)."""
        if self._ports is None:
            now = time.monotonic()
            if now - self._checked < PORTS_RECHECK_SECONDS:
                return {}
            self._checked = now
            try:
                text = self.ports_file.read_text()
            except OSError:
                return {}
            self._ports = {n: int(p) for n, p in (line.split() for line in text.splitlines())}
        return self._ports

    def exited(self) -> int | None:
        return self.process.poll()


class FleetNode:
    """A :class:`~trainguard.platform.node.LaunchedNode` served by a fleet process."""

    def __init__(self, launcher: FleetLauncher, node_id: str, incarnation: str) -> None:
        self.launcher = launcher
        self.node_id = node_id
        self.incarnation = incarnation
        self.last_pids: tuple[int, ...] = ()
        self.address = "127.0.0.1"
        self.hostname = socket.gethostname()  # every fleet process runs on this machine
        self.fleet: FleetProcess | None = None  # once the launcher spawned it

    @property
    def pid(self) -> int | None:
        return self.fleet.process.pid if self.fleet is not None else None

    @property
    def console(self) -> IO[bytes] | None:
        return None

    def port(self) -> int | None:
        return self.fleet.ports().get(self.node_id) if self.fleet is not None else None

    def exited(self) -> str | None:
        code = self.fleet.exited() if self.fleet is not None else None
        if code is None:
            return None
        return f"its fleet process exited with code {code}"

    def shutdown(self, client: AgentClient | None) -> None:
        """``/shutdown``: the fleet exits once every node of it got one."""
        if self.fleet is not None and self.fleet.exited() is None and client is not None:
            # The fleet may be gone, or going: measure() ends what is left of it.
            with contextlib.suppress(AgentError):
                client.shutdown()


class FleetLauncher:
    """The :class:`~trainguard.platform.node.NodeLauncher` of the scale job.

    The local platform launches every node of the job in one go; this launcher hands
    out a :class:`FleetNode` per call and, once it was called for every node of the job,
    spawns the fleets with each node's incarnation (``node_id incarnation`` lines).
    """

    def __init__(
        self,
        node_ids: Sequence[str],
        token_file: Path,
        fleet_dir: Path,
        *,
        nproc: int,
        victim: str,
        push: str = "faults",
        fleets: int = FLEETS,
    ) -> None:
        self.node_ids = list(node_ids)
        self.token_file = token_file
        self.fleet_dir = fleet_dir
        self.nproc = nproc
        self.victim = victim
        self.push = push
        self.fleet_count = max(1, min(fleets, len(self.node_ids)))
        self.nodes: dict[str, FleetNode] = {}
        self.fleets: list[FleetProcess] = []
        self.victim_fleet: FleetProcess | None = None

    def __call__(self, node_id: str, incarnation: str, peers: Peers | None = None) -> FleetNode:
        del peers  # simulated agents run no health checks
        if self.fleets or node_id in self.nodes:
            raise RuntimeError("the scale benchmark launches every node once")
        if node_id not in self.node_ids:
            raise RuntimeError(f"{node_id} is not a node of the scale job")
        node = self.nodes[node_id] = FleetNode(self, node_id, incarnation)
        if len(self.nodes) == len(self.node_ids):
            self._spawn()
        return node

    def _spawn(self) -> None:
        self.fleet_dir.mkdir(parents=True, exist_ok=True)
        for index in range(self.fleet_count):
            group = [self.nodes[n] for n in self.node_ids[index :: self.fleet_count]]
            nodes_file = self.fleet_dir / f"fleet{index}.nodes"
            nodes_file.write_text("".join(f"{n.node_id} {n.incarnation}\n" for n in group))
            ports_file = self.fleet_dir / f"fleet{index}.ports"
            record = self.fleet_dir / f"fleet{index}.json"
            for path in (ports_file, record):
                path.unlink(missing_ok=True)
            with open(self.fleet_dir / f"fleet{index}.log", "ab") as log:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.fleet",
                        "--token-file",
                        str(self.token_file),
                        "--nodes-file",
                        str(nodes_file),
                        "--ports-file",
                        str(ports_file),
                        "--nproc",
                        str(self.nproc),
                        "--record",
                        str(record),
                        "--victim",
                        self.victim,
                        "--push",
                        self.push,
                    ],
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            fleet = FleetProcess(process, ports_file, record)
            self.fleets.append(fleet)
            for node in group:
                node.fleet = fleet
                if node.node_id == self.victim:
                    self.victim_fleet = fleet

    def fail_victim(self) -> None:
        """SIGUSR1: the victim's first worker dies (see :mod:`bench.fleet`)."""
        if self.victim_fleet is not None:
            self.victim_fleet.process.send_signal(signal.SIGUSR1)

    def end(self, timeout: float = FLEET_EXIT_TIMEOUT) -> None:
        """Wait for the fleets to exit (every node got ``/shutdown``); end them if not."""
        deadline = time.monotonic() + timeout
        for fleet in self.fleets:
            process = fleet.process
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()  # the fleet writes its record on SIGTERM too
                try:
                    process.wait(10.0)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


class WatchingStore(Store):
    """The runner's store; tells ``on_event`` of every event the runner records (right
    after the loop turn that produced it: after a turn's deliveries all completed)."""

    def __init__(self, root: Path, on_event: Callable[[Event], None]) -> None:
        super().__init__(root)
        self._on_event = on_event

    def add_events(self, job_id: str, events: Sequence[Event]) -> None:
        super().add_events(job_id, events)
        for event in events:
            self._on_event(event)


class Conductor:
    """Fails the victim once every node got ``/start`` and a few full poll cycles went
    by; keeps those cycles' durations (a thread of its own: never block the loop)."""

    def __init__(self, runner: LocalRunner, launcher: FleetLauncher) -> None:
        self.runner = runner
        self.launcher = launcher
        self.started = threading.Event()
        self.ended = threading.Event()
        self.cycles: list[float] = []
        self.fds: int | None = None
        self.rss_kib: int | None = None
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="bench-conductor", daemon=True)

    def on_event(self, event: Event) -> None:
        if event.kind == "AttemptStarted":
            self.started.set()
        elif event.kind.startswith("Job") and event.kind != "JobStarted":
            self.ended.set()

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.ended.set()
        self._thread.join(10.0)

    def _run(self) -> None:
        while not self.started.wait(0.1):
            if self.ended.is_set():
                return
        platform = self.runner.platform
        assert platform is not None
        transport = platform.transport
        transport.cycle_seconds = []  # from now on: cycles of every node, all running
        # The first cycle began during the start broadcast; the next ones are steady.
        while len(transport.cycle_seconds) < SETTLE_CYCLES + 1:
            if self.ended.wait(0.02):
                return
        self.cycles = list(transport.cycle_seconds)[1:]
        self.fds = len(os.listdir("/proc/self/fd"))
        self.rss_kib = _proc_status_kib("VmRSS")
        self.launcher.fail_victim()
        self.failed = True


def job(nnodes: int, nproc: int) -> TrainingJob:
    return TrainingJob.model_validate(
        {
            "apiVersion": "trainguard.dev/v1",
            "kind": "TrainingJob",
            "metadata": {"name": f"scale-{nnodes}"},
            "spec": {
                "nprocPerNode": str(nproc),
                "replicaSpecs": [
                    {
                        "name": "nodes",
                        "replicas": nnodes,
                        "template": {
                            "spec": {"containers": [{"name": "sim", "command": ["true"]}]}
                        },
                    }
                ],
                "runPolicy": {"jobMaxRetryCount": 0},
                "trainguard": {"nodeStartTimeoutSeconds": 900},
            },
        }
    )


def measure(
    nnodes: int,
    workdir: Path,
    nproc: int = NPROC_PER_NODE,
    push: str = "faults",
    fleets: int = FLEETS,
) -> dict[str, Any]:
    """Run the scale job once in this process; its figures (see the module docstring)."""
    raise_open_files_limit(3 * nnodes + 1024)  # a connection or two per agent, and pushes
    plan = resolve_plan(job(nnodes, nproc), "bench.scale")
    workdir.mkdir(parents=True, exist_ok=True)
    rss_before = _proc_status_kib("VmRSS")
    conductor: Conductor | None = None

    def on_event(event: Event) -> None:
        if conductor is not None:
            conductor.on_event(event)

    store = WatchingStore(workdir / "state", on_event)
    victim = f"node-{nnodes // 2}"
    with open(workdir / "runner.log", "w", encoding="utf-8") as log:
        runner = LocalRunner(plan, store, "bench.scale", out=log, err=log)
        launcher = FleetLauncher(
            list(runner.groups),
            runner.token_file,
            workdir / "fleets",
            nproc=nproc,
            victim=victim,
            push=push,
            fleets=fleets,
        )
        runner.launcher = launcher
        conductor = Conductor(runner, launcher)
        conductor.start()
        cpu_before = _cpu_seconds()
        try:
            result = runner.run()
        finally:
            cpu = _cpu_seconds() - cpu_before
            conductor.join()
            launcher.end()
    rss_peak = _proc_status_kib("VmHWM")
    events = store.events(runner.job_id)
    store.close()
    records: dict[str, dict[str, Any]] = {}
    pushes, push_failures, push_errors, fleet_rss = 0, 0, [], []
    for fleet in launcher.fleets:
        data = json.loads(fleet.record.read_text())
        records.update(data["nodes"])
        pushes += data["pushes"]
        push_failures += data["push_failures"]
        push_errors += data["push_errors"]
        fleet_rss.append(data["rss_peak_mib"])

    def first(kind: str) -> float:
        return min(e.time for e in events if e.kind == kind)

    assigned = first("AttemptStarted")
    ended = max(e.time for e in events if e.kind.startswith("Job") and e.kind != "JobStarted")
    failed_at = records[victim]["failed_at"]
    pushed_at = records[victim]["pushed_at"]
    stops = [r["stop_at"] for r in records.values()]
    if failed_at is None or None in stops:
        raise RuntimeError(f"the fault never hit, or some node never got /stop: {result}")
    return {
        "nodes": nnodes,
        "ranks": nnodes * nproc,
        "push": push,
        "phase": result.phase.value,
        "reason": result.reason,
        "start_s": max(r["start_at"] for r in records.values()) - assigned,
        "detect_s": first("Fault") - failed_at,
        "push_s": pushed_at - failed_at if pushed_at is not None else None,
        "first_stop_s": min(stops) - failed_at,
        "stop_s": max(stops) - failed_at,
        "stop_broadcast_s": max(stops) - min(stops),
        "stopped_seen_s": ended - min(stops),
        "poll_cycle_s": statistics.median(conductor.cycles) if conductor.cycles else None,
        "poll_cycles_s": conductor.cycles,
        "launch_s": assigned - first("NodesLaunching"),
        "controller_rss_mib": (rss_peak - rss_before) / 1024,
        "controller_rss_peak_mib": rss_peak / 1024,
        "controller_rss_running_mib": (conductor.rss_kib or 0) / 1024,
        "controller_cpu_s": cpu,
        "controller_fds": conductor.fds,
        "fleet_rss_peak_mib": max(fleet_rss),
        "pushes": pushes,
        "push_failures": push_failures,
        "push_errors": push_errors,
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--nproc", type=int, default=NPROC_PER_NODE)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--push",
        choices=PUSH_MODES,
        default="faults",
        help="which changes the simulated agents push (changes: all, as a real agent)",
    )
    parser.add_argument("--fleets", type=int, default=FLEETS, help="fleet processes")
    args = parser.parse_args(argv)
    figures = measure(args.nodes, args.workdir, args.nproc, args.push, args.fleets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0 if figures["phase"] == "Failed" else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
