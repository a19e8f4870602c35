"""Control-plane scale: the local platform's runner and controller driving N simulated nodes.

    python -m bench.scale --nodes 1024 --out scale-1024.json

The real :class:`~trainguard.platform.local.LocalRunner` (its poll loop, the
:class:`~trainguard.control.controller.JobController`, the SQLite store, and
:class:`~trainguard.platform.node.LocalNode` with the real agent client) runs one job of
N nodes x 8 ranks. Only the agents are simulated: :mod:`bench.fleet` processes serve the
real agent HTTP API for every node (see there). Once the runner has sent every node its
``/start``, one worker of the middle node dies; the controller stops every node, and the
job fails (no retries). From the job's events and the times the fleets saw requests:

- ``start_s``: the controller assigns ranks (``AttemptStarted``) -> the last node got ``/start``;
- ``stop_s``: the worker died -> the last node got ``/stop`` (``detect_s``: the first one);
- ``stop_broadcast_s``: the first node got ``/stop`` -> the last one did;
- ``stopped_seen_s``: the first ``/stop`` -> the job ended (every node seen stopped);
- ``poll_cycle_s``: median time between two status polls of one node;
- ``controller_rss_mib``: the runner's process, peak resident memory over what it had
  before the job (the fleets are other processes).

Event times are the controller's ``now``, taken before a poll of every node, so a
``Fault`` event is stamped up to one poll cycle before the controller acted on it; the
fleets' own clocks (same machine) time the requests instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.runs import REPO
from trainguard.platform.local import LocalRunner
from trainguard.platform.node import LocalNode
from trainguard.platform.store import Store
from trainguard.spec import TrainingJob, resolve_plan

FLEETS = 2
NPROC_PER_NODE = 8
FLEET_EXIT_TIMEOUT = 30.0


class WatchingStore(Store):
    """The runner's store; calls ``on_all_started`` once every node was recorded starting."""

    def __init__(self, root: Path, nnodes: int, on_all_started: Callable[[], None]) -> None:
        super().__init__(root)
        self._nnodes = nnodes
        self._started: set[str] = set()
        self._on_all_started: Callable[[], None] | None = on_all_started

    def upsert_node(self, job_id: str, node_id: str, state: str, **fields: Any) -> None:
        super().upsert_node(job_id, node_id, state, **fields)
        if state == "starting":
            self._started.add(node_id)
        if len(self._started) == self._nnodes and self._on_all_started is not None:
            callback, self._on_all_started = self._on_all_started, None
            callback()


class FleetRunner(LocalRunner):
    """The local runner, with the node agents in :mod:`bench.fleet` processes.

    Only bringing nodes up differs from :class:`LocalRunner`: instead of one agent
    process per node, a few fleet processes serve every node; each node's
    :class:`LocalNode` watches its fleet's process and finds its port the usual way.
    """

    def __init__(self, *args: Any, victim: str, fleet_dir: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.victim = victim
        self.fleet_dir = fleet_dir
        self.fleets: list[subprocess.Popen[bytes]] = []
        self.victim_fleet: subprocess.Popen[bytes] | None = None

    def _bring_up(self, node_ids: Sequence[str]) -> None:
        if self.fleets:
            raise RuntimeError("the scale benchmark brings nodes up once")
        self.fleet_dir.mkdir(parents=True, exist_ok=True)
        groups = [list(node_ids[i::FLEETS]) for i in range(FLEETS)]
        for index, group in enumerate(groups):
            nodes_file = self.fleet_dir / f"fleet{index}.nodes"
            nodes_file.write_text("\n".join(group) + "\n")
            fleet = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.fleet",
                    "--job-dir",
                    str(self.job_dir),
                    "--token-file",
                    str(self.token_file),
                    "--nodes-file",
                    str(nodes_file),
                    "--nproc",
                    str(self.plan.nproc_per_node),
                    "--record",
                    str(self.fleet_dir / f"fleet{index}.json"),
                    "--victim",
                    self.victim,
                ],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.fleets.append(fleet)
            for node_id in group:
                node = LocalNode(node_id, self._groups[node_id], self.job_dir, self._token, {})
                node.process = fleet
                self.nodes[node_id] = node
                if node_id == self.victim:
                    self.victim_fleet = fleet
        deadline = time.monotonic() + self.plan.node_start_timeout_seconds
        for node_id in node_ids:
            node = self.nodes[node_id]
            node.wait_ready(deadline)
            self.store.upsert_node(
                self.job_id,
                node_id,
                "ready",
                agent_pid=node.process.pid if node.process else None,
                agent_url=node.url,
            )

    def fail_victim(self) -> None:
        if self.victim_fleet is not None:
            self.victim_fleet.send_signal(signal.SIGUSR1)


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


def measure(nnodes: int, workdir: Path, nproc: int = NPROC_PER_NODE) -> dict[str, Any]:
    """Run the scale job once in this process; its figures (see the module docstring)."""
    plan = resolve_plan(job(nnodes, nproc), "bench.scale")
    rss_before = _proc_status_kib("VmRSS")
    runner: FleetRunner | None = None

    def fail_victim() -> None:
        assert runner is not None
        runner.fail_victim()

    store = WatchingStore(workdir / "state", nnodes, fail_victim)
    with open(workdir / "runner.log", "w", encoding="utf-8") as log:
        runner = FleetRunner(
            plan,
            store,
            "bench.scale",
            out=log,
            err=log,
            victim=f"node-{nnodes // 2}",
            fleet_dir=workdir / "fleets",
        )
        try:
            result = runner.run()
        finally:
            for fleet in runner.fleets:
                try:
                    fleet.wait(FLEET_EXIT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    fleet.kill()
                    fleet.wait()
    rss_peak = _proc_status_kib("VmHWM")
    events = store.events(runner.job_id)
    store.close()
    records: dict[str, dict[str, Any]] = {}
    status_times: list[float] = []
    for index in range(FLEETS):
        data = json.loads((workdir / "fleets" / f"fleet{index}.json").read_text())
        records.update(data["nodes"])
        status_times = status_times or data["status_times"]

    assigned = min(e.time for e in events if e.kind == "AttemptStarted")
    ended = max(e.time for e in events if e.kind.startswith("Job") and e.kind != "JobStarted")
    failed_at = records[runner.victim]["failed_at"]
    stops = [r["stop_at"] for r in records.values()]
    polls = [b - a for a, b in itertools.pairwise(status_times)]
    return {
        "nodes": nnodes,
        "ranks": nnodes * nproc,
        "phase": result.phase.value,
        "reason": result.reason,
        "start_s": max(r["start_at"] for r in records.values()) - assigned,
        "detect_s": min(stops) - failed_at,
        "stop_s": max(stops) - failed_at,
        "stop_broadcast_s": max(stops) - min(stops),
        "stopped_seen_s": ended - min(stops),
        "poll_cycle_s": statistics.median(polls) if polls else None,
        "controller_rss_mib": (rss_peak - rss_before) / 1024,
        "controller_rss_peak_mib": rss_peak / 1024,
    }


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
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    figures = measure(args.nodes, args.workdir, args.nproc)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0 if figures["phase"] == "Failed" else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
