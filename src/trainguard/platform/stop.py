"""``stop`` and ``delete``: act on a local job through the store.

``stop`` asks the job's controller to stop every rank and keeps the job (its phase
becomes Stopped); ``delete`` stops it too, then removes its record, logs and memory tier,
keeping its durable checkpoints unless asked. A job whose controller died (Lost) has
what is left of it killed: only a recorded pid whose start time still matches is ever
signalled.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from trainguard.platform.local import MEMORY_ROOT
from trainguard.platform.procs import alive, kill_recorded
from trainguard.platform.store import JobRow, Store
from trainguard.platform.views import FOLLOW_INTERVAL_SECONDS, TERMINAL_PHASES, effective_phase

__all__ = ["CHECKPOINT_DIRS", "delete", "stop"]


def stop(store: Store, ref: str, timeout: float) -> int:
    """Stop a running job and keep its record: its controller stops every rank and records
    the job as Stopped. A Lost job (its controller died) has its agents and workers
    killed and is recorded as Stopped here."""
    job = store.job(ref)
    phase = effective_phase(job)
    if phase in TERMINAL_PHASES:
        print(f"job {job.id} is already {phase}")
        return 0
    if phase != "Lost":
        stopped = _stop_running(store, job, timeout, "stop", force=False)
        if stopped is None:
            return 1
        job, phase = stopped, effective_phase(stopped)
        if phase != "Lost":
            print(f"job {job.id} {phase.lower()}")
            return 0
    _reap(store, job.id)
    shutil.rmtree(MEMORY_ROOT / job.id, ignore_errors=True)  # its nodes' memory tiers
    store.update_job(
        job.id, phase="Stopped", reason="stopped by user (its controller had died)",
        finished_at=time.time(),
    )  # fmt: skip
    print(f"job {job.id} stopped")
    return 0


def delete(
    store: Store, ref: str, timeout: float, force: bool = False, checkpoints: bool = False
) -> int:
    """Stop the job if it runs, then remove its record, logs and memory tier; its durable
    checkpoints only with ``checkpoints`` (else they are kept, and named).

    A running job's controller is asked to stop it, for up to ``timeout`` seconds. What a
    dead controller left (agents, workers) is killed. ``force``: a controller that does
    not stop in time is killed too, and the job is removed whatever its record says.
    Only a recorded pid whose start time still matches is ever signalled.
    """
    job = store.job(ref)
    if effective_phase(job) not in (*TERMINAL_PHASES, "Lost"):
        stopped = _stop_running(store, job, timeout, "delete", force)
        if stopped is None:
            return 1
        job = stopped
    if force or effective_phase(store.job(job.id)) == "Lost":
        _reap(store, job.id)
    store.remove_job(job.id)
    kept = _remove_files(job, checkpoints)
    shutil.rmtree(MEMORY_ROOT / job.id, ignore_errors=True)  # its nodes' memory tiers
    print(f"job {job.id} deleted")
    for place in kept:
        print(f"  its checkpoints are kept: {place}")
    if kept and not checkpoints:
        print("  (`delete --checkpoints` removes them with the job; now `rm -r` them)")
    return 0


CHECKPOINT_DIRS = ("durable", "checkpoints")
"""What ``delete`` keeps of a job's directory unless asked: the durable tier's default
place, and where a script saves its own (``$TRAINGUARD_JOB_DIR/checkpoints``)."""


def _remove_files(job: JobRow, checkpoints: bool) -> list[str]:
    """Remove the job's directory, but for its checkpoints unless ``checkpoints``; the
    places of the checkpoints left."""
    job_dir = Path(job.job_dir)
    keep = [] if checkpoints else [job_dir / n for n in CHECKPOINT_DIRS if (job_dir / n).exists()]
    if not keep:
        shutil.rmtree(job_dir, ignore_errors=True)
    else:
        for path in job_dir.iterdir():
            if path in keep:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    kept = [str(path) for path in keep]
    url = _durable_url(job)
    if url is not None:
        local = url.removeprefix("file://")
        if "://" in local:
            kept.append(f"{url.rstrip('/')}/{job.id} (not on this machine: never removed here)")
        elif checkpoints:
            shutil.rmtree(Path(local) / job.id, ignore_errors=True)
        elif (Path(local) / job.id).exists():
            kept.append(str(Path(local) / job.id))
    return kept


def _durable_url(job: JobRow) -> str | None:
    """The spec's ``checkpointing.durableUrl`` (None: the job directory's ``durable``)."""
    try:
        spec = json.loads(job.spec_json)["spec"]
        url = (spec.get("checkpointing") or {}).get("durableUrl")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return url if isinstance(url, str) and url else None


def _stop_running(
    store: Store, job: JobRow, timeout: float, desired: str, force: bool
) -> JobRow | None:
    """Ask the job's controller to stop it (``desired``: why, as the store records it)
    and wait until it has; None (a message said why) when it did not in ``timeout``
    seconds, unless ``force``: then its controller is killed."""
    store.request(job.id, desired)
    deadline = time.monotonic() + timeout
    while effective_phase(job := store.job(job.id)) not in (*TERMINAL_PHASES, "Lost"):
        if time.monotonic() > deadline:
            if not force:
                again = "delete --force kills it" if desired == "delete" else "it may still stop"
                print(
                    f"trainguard: job {job.id} did not stop within {timeout:g}s; "
                    f"it was left in place ({again})",
                    file=sys.stderr,
                )
                return None
            if _kill(job.id, "controller", job.controller_pid, job.controller_started, False):
                print(f"trainguard: job {job.id}: killed its controller", file=sys.stderr)
            break
        time.sleep(FOLLOW_INTERVAL_SECONDS)
    return job


def _reap(store: Store, job_id: str) -> None:
    """Kill what a dead controller left behind: its agents and their workers."""
    for node in store.nodes(job_id):
        _kill(job_id, "agent", node["agent_pid"], node["agent_started"])
        starts = node["worker_starts"]
        for i, pid in enumerate(node["worker_pids"]):
            _kill(job_id, "worker", pid, starts[i] if i < len(starts) else None)


def _kill(job_id: str, what: str, pid: int | None, started: str | None, group: bool = True) -> bool:
    """SIGKILL a recorded process (and its group) if its pid still names it; a process
    that now has the pid, but not the recorded start time, is left alone (and named)."""
    if not pid:
        return False
    if kill_recorded(pid, started, group):
        return True
    if not alive(pid):
        return False
    why = "its pid was reused" if started else "no start time was recorded to tell it by"
    print(
        f"trainguard: job {job_id}: left pid {pid} alone: not the job's {what} ({why})",
        file=sys.stderr,
    )
    return False
