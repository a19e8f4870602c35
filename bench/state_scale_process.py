"""``state_scale``'s process-level side: the memory tier under the real ``trainguard run``.

``bench/state_scale_train.py --mode process`` as a one-node job (2 ranks) whose
Checkpointer snapshots into the memory tier every 5 steps (as the relaunch does);
``--inject kill:rank=1@step=12`` SIGKILLs rank 1, the node agent restarts the workers, and
they restore from the memory tier. Unlike the checkpointless side, the agent's detection
and restart are in these figures: the fault is the injection's ``FaultInjected`` time.

Besides :func:`~bench.state_scale._figures`, :func:`process_level` gives each restarted
rank's start (``start``): the fault to its process's start (the agent noticing the exit,
stopping the others and starting the workers again), then each phase of the script's start
(interpreter and imports, process group, model build, ``load_latest``, DDP), and the
restore's own seconds and phases (plan, checksum, copy, slots readied) as the
Checkpointer reports them (``Restore.phases``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.runs import TrainArgs, TrainguardJob, TrainguardRun, event_times
from bench.state_scale import KILL_STEP, STEPS, TRAIN, _figures

SNAPSHOT_EVERY = 5
PHASES = ("imports", "group", "model", "load", "ddp")
"""The script's start, in order (``state_scale_train.py`` writes when each ended)."""


@dataclass(frozen=True)
class OneNodeJob(TrainguardJob):
    """A one-node job of 2 ranks running ``command`` (not ``bench/train.py``)."""

    command: tuple[str, ...] = ()

    def spec(self, args: TrainArgs, out: Path) -> dict[str, Any]:
        job = super().spec(args, out)
        replicas = job["spec"]["replicaSpecs"][0]
        replicas["replicas"] = 1
        replicas["template"]["spec"]["containers"][0]["command"] = list(self.command)
        return job


def start_phases(record: dict[str, Any], fault_at: float) -> dict[str, Any]:
    """One restarted rank's start record as seconds: the fault to its process's start,
    then each phase (the first from the process's start), and the total to DDP ready."""
    phases = record["phases"]
    result: dict[str, Any] = {"restart_s": record["process_started"] - fault_at}
    before = record["process_started"]
    for name in PHASES:
        if name in phases:
            result[f"{name}_s"] = phases[name] - before
            before = phases[name]
    result["ready_s"] = before - fault_at
    result["restored_step"] = record.get("restored_step")
    result["restore_s"] = record.get("restore_s")
    result["restore_tier"] = record.get("restore_tier")
    result["restore_phases"] = record.get("restore_phases")
    return result


def starts(out: Path, fault_at: float) -> dict[str, dict[str, Any]]:
    """Each rank's first start after the fault (by rank), as :func:`start_phases`."""
    found: dict[str, dict[str, Any]] = {}
    records = [json.loads(p.read_text()) for p in sorted(out.glob("start-*.json"))]
    for record in sorted(records, key=lambda r: float(r["process_started"])):
        key = str(record["rank"])
        if record["process_started"] >= fault_at and key not in found:
            found[key] = start_phases(record, fault_at)
    return found


def process_level(workdir: Path, state_gb: float, timeout: float) -> dict[str, Any]:
    """One process-level recovery from the memory tier (see the module doc)."""
    work = workdir / f"process-{state_gb}"
    command = (
        "python",
        str(TRAIN),
        *("--out", str(work / "out"), "--state-gb", str(state_gb), "--steps", str(STEPS)),
        *("--mode", "process"),
    )
    job = OneNodeJob(
        "bench-state-scale", retries=2, memory_every_steps=SNAPSHOT_EVERY, command=command
    )
    run = TrainguardRun(work, TrainArgs(steps=STEPS), job)
    run.out.mkdir(parents=True, exist_ok=True)
    try:
        run.start([f"kill:rank=1@step={KILL_STEP}"])
        finished = run.wait(timeout)
    finally:
        run.stop()
    described = run.describe()
    injected = event_times(described, "FaultInjected")
    if not finished or described["phase"] != "Succeeded" or not injected:
        why = f"job {described['phase']}: {described.get('reason')}"
        raise RuntimeError(f"process-level run failed ({why}): {run.log_text()[-3000:]}")
    fault_at = injected[0]
    first_pid = _pids(run.out)[0]
    result = _figures(run.out, fault_at, first_pid)
    result["start"] = starts(run.out, fault_at)
    restored = [
        e.get("data") or {} for e in described["events"] if e["kind"] == "CheckpointRestored"
    ]
    result["restores"] = [
        {k: d.get(k) for k in ("step", "tier", "seconds")} for d in restored if d.get("step")
    ]
    return result


def _pids(out: Path) -> list[int]:
    """Rank 0's pids in the step records, oldest first (the first is the faulted one)."""
    pids: list[int] = []
    for line in (out / "steps.jsonl").read_text().splitlines():
        pid = int(json.loads(line)["pid"])
        if pid not in pids:
            pids.append(pid)
    return pids or [0]


if __name__ == "__main__":  # one size by hand: python -m bench.state_scale_process 0.4 DIR
    print(json.dumps(process_level(Path(sys.argv[2]), float(sys.argv[1]), 600.0), indent=1))
