"""Events a worker reports to the job's timeline (a checkpoint restored, committed, ...).

The worker side, :func:`emit`, appends one JSON line per event to its rank's
file in ``TRAINGUARD_EVENT_DIR`` (set by the agent per attempt; without it the
call does nothing, so scripts still run under plain torchrun). The agent reads
the files with :func:`read_events` and reports them in ``GET /status``; the
controller adds each one, once, to the job's events.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from trainguard.control.events import EventKind
from trainguard.wire.status import WorkerEvent

EVENT_DIR_ENV: Final = "TRAINGUARD_EVENT_DIR"
# A rank's events the agent reports: its latest ones (a restarted worker starts a new file).
MAX_EVENTS_PER_RANK: Final = 100
_FILE = re.compile(r"rank-(\d+)\.jsonl")
# The kinds a worker reports. Any other is not the worker's to report: a worker writes
# its event file itself, and a "JobSucceeded" of its making would read as the
# controller's on the console and the timeline. Such lines are skipped.
WORKER_KINDS: Final = frozenset(
    {
        EventKind.CHECKPOINT_RESTORED,
        EventKind.CHECKPOINT_SKIPPED,
        EventKind.CHECKPOINT_SAVED,
        EventKind.CHECKPOINT_COMMITTED,
        EventKind.CHECKPOINT_MEMORY_FULL,
        EventKind.IN_PROCESS_RESTART,
        EventKind.ATTEMPT_JOINED,
        EventKind.CUDA_UNHEALTHY,
        EventKind.BARRIER_TIMEOUT,
    }
)
_lock = threading.Lock()
_seq = 0


def emit(kind: str, message: str, **data: Any) -> None:
    """Record an event of this rank in the job's timeline; a no-op outside trainguard."""
    global _seq
    directory = os.environ.get(EVENT_DIR_ENV)
    if not directory:
        return
    rank = int(os.environ.get("RANK", "0"))
    with _lock:
        _seq += 1
        line = json.dumps(
            {"seq": _seq, "time": time.time(), "kind": kind, "message": message, "data": data},
            default=str,
        )
        try:
            with open(os.path.join(directory, f"rank-{rank}.jsonl"), "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError:
            pass  # the timeline is best effort; training goes on


def read_events(directory: str | Path) -> list[WorkerEvent]:
    """Every rank's latest events (at most MAX_EVENTS_PER_RANK each); bad lines, and
    kinds not in WORKER_KINDS, are skipped."""
    events: list[WorkerEvent] = []
    try:
        entries = sorted(Path(directory).iterdir())
    except OSError:
        return events
    for path in entries:
        name = _FILE.fullmatch(path.name)
        if name is None:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()[-MAX_EVENTS_PER_RANK:]
        except OSError:
            continue
        for line in lines:
            try:
                raw = json.loads(line)
            except ValueError:
                continue  # a line being written
            if isinstance(raw, dict) and raw.get("kind") in WORKER_KINDS:
                raw["rank"] = int(name.group(1))
                try:
                    events.append(WorkerEvent.model_validate(raw, strict=False))
                except ValidationError:
                    continue  # a line of someone else's making
    return events
