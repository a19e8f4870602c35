"""Recovery from one SIGKILLed rank, and from one SIGSTOPped (hung) rank: 2 nodes x 2 ranks.

Each variant is a function of a :class:`FaultSetup` returning a :class:`FaultRecord`,
computed from the step records the same way for every variant: ``stall_s`` is the
fault to the next step completed by a later incarnation, ``lost_steps`` the completed
steps redone. Add a variant by appending it to :data:`RECOVERY_VARIANTS` (or
:data:`HANG_VARIANTS`).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.baseline import POLL_SECONDS, Relaunch, free_port, signal_at_step
from bench.runs import (
    NNODES,
    Run,
    TorchrunRun,
    TrainArgs,
    TrainguardJob,
    TrainguardRun,
    event_times,
)
from bench.stall_breakdown import breakdown
from bench.steps import StepRecord, recovery_after

FAULTY_RANK = 3  # node 1, local rank 1: not the rank that hosts trainguard's store
HANG_RULE_SECONDS = 5.0
"""expectedRecurringFrequencyInSeconds of the hang rule in every trainguard job here."""
TORCHRUN_MAX_RESTARTS = 1


def log_rules(hang_seconds: float = HANG_RULE_SECONDS) -> list[dict[str, Any]]:
    """The log rules every benchmark job under trainguard runs with (HyperPod's example)."""
    return [
        {"name": "JobStart", "logPattern": ".*Loss:.*", "expectedStartCutOffInSeconds": 180},
        {
            "name": "JobHangingDetection",
            "logPattern": ".*Loss:.*",
            "expectedRecurringFrequencyInSeconds": hang_seconds,
        },
        {
            "name": "Throughput",
            "logPattern": r".*Speed: ([0-9.]+) samples/sec.*",
            "metricThreshold": 1,
            "operator": "lteq",
            "metricEvaluationDataPoints": 3,
        },
    ]


@dataclass(frozen=True)
class FaultSetup:
    """Where and when the fault hits; ``workdir`` is this variant's own directory."""

    workdir: Path
    args: TrainArgs
    step: int
    timeout: float = 240.0  # the whole run, start to finish
    cap: float = 60.0  # how long a baseline that may never recover gets, after the fault


@dataclass(frozen=True)
class FaultRecord:
    """One faulted run of one variant. Times in seconds after the fault."""

    recovered: bool
    fault_step: int | None = None  # last step of the faulted incarnation (may end after it)
    resumed_step: int | None = None
    stall_s: float | None = None  # fault -> next completed step
    lost_steps: int | None = None
    detect_s: float | None = None  # fault -> the launcher noticed (None: it never did)
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    step_at_fault: int | None = None  # last step completed when the fault hit
    # trainguard: the step its injector hit minus the step it was named (None: not known)
    injection_lag_steps: int | None = None
    # an in-process recovery: where its stall went (bench/stall_breakdown.py)
    breakdown: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Variant = Callable[[FaultSetup], FaultRecord]


def from_steps(
    records: list[StepRecord], fault_at: float | None, detect_s: float | None, note: str = ""
) -> FaultRecord:
    """The record of a fault at ``fault_at`` (None: it was never injected)."""
    if fault_at is None:
        return FaultRecord(False, note=note or "the fault was never injected")
    at_fault = max((r.step for r in records if r.end <= fault_at), default=None)
    recovery = recovery_after(records, fault_at)
    if recovery is None:
        done = [r.step for r in records if r.start <= fault_at]
        note = note or "no step was completed after the fault (by a later incarnation)"
        return FaultRecord(
            False, max(done, default=None), detect_s=detect_s, note=note, step_at_fault=at_fault
        )
    return FaultRecord(
        True,
        recovery.fault_step,
        recovery.resumed_step,
        recovery.stall_s,
        recovery.lost_steps,
        detect_s,
        note,
        step_at_fault=at_fault,
    )


# -- SIGKILL ------------------------------------------------------------------


def trainguard_kill(setup: FaultSetup) -> FaultRecord:
    """``trainguard run --inject kill:rank=3@step=S``; process-level restart from memory."""
    job = TrainguardJob("bench-recovery", retries=3, log_rules=log_rules())
    run = TrainguardRun(setup.workdir, setup.args, job)
    return trainguard_fault(run, f"kill:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


def kill_under(job: TrainguardJob, setup: FaultSetup) -> FaultRecord:
    """``job`` run with ``--inject kill:rank=3@step=S`` (a scenario's own job)."""
    run = TrainguardRun(setup.workdir, setup.args, job)
    return trainguard_fault(run, f"kill:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


def checkpointless_job(name: str, retries: int) -> TrainguardJob:
    """A job whose script runs in ``@restartable`` (``--ckpt resilient``), with
    ``inProcessRestart`` and a hot spare on every node: a killed rank is taken over by
    its node's spare, which gets its state from a peer, while the others keep their
    processes."""
    return TrainguardJob(
        name,
        retries=retries,
        log_rules=log_rules(),
        ckpt="resilient",
        spec_fields={"trainguard": {"inProcessRestart": True, "hotSpares": NNODES}},
    )


def checkpointless_kill(setup: FaultSetup) -> FaultRecord:
    """``--inject kill:rank=3@step=S`` with in-process restarts and hot spares."""
    run = TrainguardRun(setup.workdir, setup.args, checkpointless_job("bench-checkpointless", 3))
    return trainguard_fault(run, f"kill:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


def relaunch_kill(setup: FaultSetup) -> FaultRecord:
    """SIGKILL under torchrun; when torchrun has exited, launch it again (resumes from disk)."""
    relaunch = Relaunch(setup.workdir, setup.args, max_launches=3)
    try:
        relaunch.start()
        fault_at = signal_at_step(
            relaunch.steps,
            relaunch.rank_process,
            FAULTY_RANK,
            setup.step,
            signal.SIGKILL,
            setup.timeout,
        )
        relaunch.wait(setup.timeout)
    finally:
        relaunch.stop()
    exits = [t for t in relaunch.exits if fault_at is not None and t >= fault_at]
    detect = exits[0] - fault_at if exits and fault_at is not None else None
    note = "" if relaunch.succeeded else "the relaunched job did not complete"
    return from_steps(relaunch.steps(), fault_at, detect, note)


def torchrun_restart_kill(setup: FaultSetup) -> FaultRecord:
    """SIGKILL under ``torchrun --max-restarts``: torchrun restarts the workers itself."""
    run = TorchrunRun(
        setup.workdir, setup.args, run_id="maxrestarts", max_restarts=TORCHRUN_MAX_RESTARTS
    )
    try:
        run.start(free_port())
        fault_at = signal_at_step(
            run.steps, run.rank_process, FAULTY_RANK, setup.step, signal.SIGKILL, setup.timeout
        )
        if fault_at is not None:
            _wait_for_recovery(run, fault_at, fault_at + setup.cap)
            run.wait(setup.timeout if recovery_after(run.steps(), fault_at) else 5.0)
        codes = run.returncodes
    finally:
        run.stop()
    record = from_steps(run.steps(), fault_at, None)
    if record.recovered:
        return record
    why = _first_line(run.log_text(), "connectFullMesh failed") or "no step after the fault"
    how = f"exit codes {codes}" if None not in codes else f"no step within {setup.cap:g} s"
    note = f"did not recover ({TORCHRUN_MAX_RESTARTS} restart, {how}): {why}"
    return replace(record, note=note, detail={"cap_s": setup.cap})


RECOVERY_VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", trainguard_kill),
    ("trainguard_checkpointless", checkpointless_kill),
    ("baseline_relaunch", relaunch_kill),
    ("baseline_torchrun_max_restarts", torchrun_restart_kill),
]


# -- SIGSTOP ------------------------------------------------------------------


def trainguard_hang(setup: FaultSetup) -> FaultRecord:
    """``--inject hang:rank=3@step=S``, found by the hang log rule, then a restart."""
    job = TrainguardJob("bench-hang", retries=3, log_rules=log_rules())
    run = TrainguardRun(setup.workdir, setup.args, job)
    return trainguard_fault(run, f"hang:rank={FAULTY_RANK}@step={setup.step}", setup.timeout)


def torchrun_hang(setup: FaultSetup) -> FaultRecord:
    """SIGSTOP under torchrun: the others wait in the all-reduce; capped at ``cap``."""
    run = TorchrunRun(setup.workdir, setup.args, run_id="hang", max_restarts=1)
    try:
        run.start(free_port())
        fault_at = signal_at_step(
            run.steps, run.rank_process, FAULTY_RANK, setup.step, signal.SIGSTOP, setup.timeout
        )
        if fault_at is not None:
            _wait_for_recovery(run, fault_at, fault_at + setup.cap)
    finally:
        run.stop()
    record = from_steps(run.steps(), fault_at, None)
    if record.recovered:
        return record
    note = f"> {setup.cap:g} s: no step and no fault detected within the cap"
    return replace(record, note=note, detail={"cap_s": setup.cap})


HANG_VARIANTS: list[tuple[str, Variant]] = [
    ("trainguard", trainguard_hang),
    ("baseline_torchrun", torchrun_hang),
]


# -- shared -------------------------------------------------------------------


def trainguard_fault(run: TrainguardRun, injection: str, timeout: float) -> FaultRecord:
    """Run ``run`` with ``--inject injection``; the record from its steps and its timeline."""
    try:
        run.start([injection])
        finished = run.wait(timeout)
    finally:
        run.stop()
    job = run.describe()
    injected = event_times(job, "FaultInjected")
    fault_at = injected[0] if injected else None
    faults = job["faults"]
    detect = faults[0]["detected_at"] - fault_at if faults and fault_at is not None else None
    ok = finished and job["phase"] == "Succeeded"
    note = "" if ok else f"job {job['phase']}: {job['reason']}"
    record = from_steps(run.steps(), fault_at, detect, note)
    record = replace(record, injection_lag_steps=injection_lag(job))
    if fault_at is not None and faults and faults[0].get("scope") == "in-process":
        record = replace(record, breakdown=breakdown(job, fault_at, record.stall_s))
    if faults:  # trainguard's own view of the same fault, for cross-checking
        own = {k: faults[0].get(k) for k in ("type", "recovery_seconds", "lost_steps", "scope")}
        record = replace(record, detail={"timeline": own})
    return record


def injection_lag(job: dict[str, Any]) -> int | None:
    """Steps between the step a job's first ``@step=S`` injection named and the one its
    ``FaultInjected`` event says it hit."""
    for event in job["events"]:
        data = event.get("data") or {}
        named = re.search(r"@step=(\d+)$", str(data.get("spec", "")))
        if event["kind"] == "FaultInjected" and named and isinstance(data.get("step"), int):
            return int(data["step"]) - int(named.group(1))
    return None


def _wait_for_recovery(run: Run, fault_at: float, until: float) -> None:
    while time.time() < until and all(code is None for code in run.returncodes):
        if recovery_after(run.steps(), fault_at) is not None:
            return
        time.sleep(POLL_SECONDS * 4)


def _first_line(text: str, needle: str) -> str | None:
    for line in text.splitlines():
        if needle in line:
            return line.strip()[:300]
    return None
