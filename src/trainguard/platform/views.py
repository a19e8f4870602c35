"""``list``, ``describe`` and ``logs``: read the store (``stop`` and ``delete`` act on it:
:mod:`trainguard.platform.stop`).

The JSON of ``describe -o json`` is a stable interface; see the README's
"describe -o json" section before changing a key.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from trainguard.control.events import EventKind
from trainguard.observe.account import account
from trainguard.observe.cause import failure_cause
from trainguard.observe.durable import DurableState, durable_state
from trainguard.observe.history import load_history
from trainguard.observe.terminal import safe_bytes, safe_cell
from trainguard.platform.procs import alive, runs
from trainguard.platform.remote_log import follow_remote, remote_holder
from trainguard.platform.store import JobRow, Store
from trainguard.spec.secrets import redact_spec

TERMINAL_PHASES = ("Succeeded", "Failed", "Stopped")
JOINED = "joined "  # how a joined host's record of a job names its source
# How often `logs -f`, `stop` and `delete` look again.
FOLLOW_INTERVAL_SECONDS = 0.25

Cell = Callable[[dict[str, Any]], str]
"""How a column of a ``describe`` table shows one item."""


def stamp(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def effective_phase(job: JobRow) -> str:
    """The job's phase, or ``Lost`` when its controller died without recording an end."""
    if job.phase not in TERMINAL_PHASES and not controller_runs(job):
        return "Lost"
    return job.phase


def controller_runs(job: JobRow) -> bool:
    """Whether the job's controller still runs: its pid, with the start time recorded
    (a later process that reuses the pid is not the controller)."""
    if job.controller_started is None:  # recorded by an older trainguard, or no /proc
        return alive(job.controller_pid)
    return runs(job.controller_pid, job.controller_started)


def job_json(store: Store, job: JobRow) -> dict[str, Any]:
    history = load_history(store, job.id)  # its attempts, events, faults and samples
    duration = None
    if job.started_at:
        duration = (job.finished_at or time.time()) - job.started_at
    return {
        "id": job.id,
        "name": job.name,
        "phase": effective_phase(job),
        "reason": job.reason,
        # A failed job's cause: the fault that started the failure, then its reason.
        "cause": failure_cause(history.events) if job.phase == "Failed" else None,
        "source": job.source,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "duration_seconds": duration,
        "restarts": job.restarts,
        "nnodes": job.nnodes,
        "nproc_per_node": job.nproc_per_node,
        "world_size": job.nnodes * job.nproc_per_node,
        "job_dir": job.job_dir,
        "logs_dir": str(Path(job.job_dir) / "logs"),
        "nodes": store.nodes(job.id),
        "attempts": store.attempts(job.id),
        "faults": json.loads(job.faults_json),
        "accounting": account(history, time.time()).to_json(),
        "checkpoints": durable_state(history.events).to_json(),
        "events": [e.to_json() for e in history.events],
        "spec": redact_spec(json.loads(job.spec_json)),  # also a row stored before redaction
    }


def list_jobs(store: Store, output: str) -> int:
    jobs = store.jobs()
    if output == "json":
        print(json.dumps([_summary(j) for j in jobs], indent=2))
        return 0
    rows = [["JOB", "PHASE", "NODES", "RANKS", "RESTARTS", "CREATED"]]
    rows += [
        [
            j.id,
            effective_phase(j),
            str(j.nnodes),
            str(j.nnodes * j.nproc_per_node),
            str(j.restarts),
            stamp(j.created_at),
        ]
        for j in jobs
    ]
    _table(rows)
    return 0


def _summary(job: JobRow) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "phase": effective_phase(job),
        "reason": job.reason,
        "nnodes": job.nnodes,
        "nproc_per_node": job.nproc_per_node,
        "restarts": job.restarts,
        "created_at": job.created_at,
        "finished_at": job.finished_at,
    }


STACK_LINES = 40
"""Lines of each rank's captured stack that ``describe`` prints (``-o json`` has all)."""


def _print_stacks(faults: list[dict[str, Any]]) -> None:
    """The stacks captured for hangs (a LogHang, an ExitHang, ...), rank by rank."""
    for f in faults:
        stacks = f["evidence"].get("stacks") or {}
        for rank, text in sorted(stacks.items(), key=lambda kv: int(kv[0])):
            lines = str(text).splitlines()
            print(f"\nStacks of rank {rank} ({f['type']}, attempt {f['attempt']}):")
            for line in lines[:STACK_LINES]:
                print(f"  {safe_cell(line)}")
            if len(lines) > STACK_LINES:
                print(f"  ... {len(lines) - STACK_LINES} more lines: describe -o json")


def describe(store: Store, ref: str, output: str) -> int:
    data = job_json(store, store.job(ref))
    if output == "json":
        print(json.dumps(data, indent=2))
        return 0
    duration = data["duration_seconds"]
    for label, value in [
        ("Job", data["id"]),
        ("Phase", data["phase"]),
        ("Reason", data["reason"] or "-"),
        ("Source", data["source"]),
        (
            "Topology",
            f"{data['nnodes']} nodes x {data['nproc_per_node']} processes "
            f"(world size {data['world_size']})",
        ),
        ("Restarts", data["restarts"]),
        ("Created", stamp(data["created_at"])),
        ("Started", stamp(data["started_at"])),
        ("Finished", stamp(data["finished_at"])),
        ("Duration", f"{duration:.1f}s" if duration is not None else "-"),
        ("Goodput", _goodput(data["accounting"])),
        ("Durable", DurableState.from_json(data["checkpoints"]).line()),
        ("Logs", data["logs_dir"]),
    ]:
        print(f"{label + ':':<10} {safe_cell(str(value))}")
        if label == "Reason" and data["cause"] not in (None, data["reason"]):
            print(f"{'Cause:':<10} {safe_cell(str(data['cause']))}")
    if (data["source"] or "").startswith(JOINED):
        print(
            f"\nThis host {data['source']}: its record follows the job's phase and restarts,"
            " and holds this host's ranks' logs; the controller's host has every fault, "
            "node and rank (trainguard describe there)."
        )
    _section(
        "Nodes",
        data["nodes"],
        {
            "NODE": lambda n: n["node_id"],
            "NODE RANK": lambda n: dash(n["node_rank"]),
            "RANKS": lambda n: ",".join(map(str, n["ranks"])) or "-",
            "STATE": lambda n: n["state"],
            "ATTEMPT": lambda n: dash(n["attempt"]),
            "HOST": lambda n: n["host"] or "-",
            "PIDS": lambda n: _pids(n["workers"]),
            "AGENT": lambda n: n["agent_url"] or "-",
        },
    )
    _section(
        "Attempts",
        data["attempts"],
        {
            "#": lambda a: str(a["number"]),
            "PHASE": lambda a: a["phase"],
            "STARTED": lambda a: stamp(a["started_at"]),
            "ENDED": lambda a: stamp(a["ended_at"]),
            "RENDEZVOUS": lambda a: f"{a['master_addr']}:{a['master_port']}",
            "REASON": lambda a: a["reason"] or "-",
        },
    )
    if data["faults"]:
        _section(
            "Faults",
            data["faults"],
            {
                "DETECTED": lambda f: stamp(f["detected_at"]),
                "TYPE": lambda f: (
                    f["type"] + (" (injected)" if f["evidence"].get("injected") else "")
                ),
                "ATTEMPT": lambda f: str(f["attempt"]),
                "NODE": lambda f: f["node"] or "-",
                "RANK": lambda f: dash(f["rank"]),
                "STEP": lambda f: dash(f["fault_step"]),
                "RESUMED": lambda f: dash(f["resumed_step"]),
                "SCOPE": lambda f: f["scope"] or "-",
                "RECOVERY": lambda f: (
                    "-" if f["recovery_seconds"] is None else f"{f['recovery_seconds']:.1f}s"
                ),
                "LOST STEPS": lambda f: dash(f["lost_steps"]),
                "MESSAGE": lambda f: f["message"][:120],
            },
        )
        _print_stacks(data["faults"])
    _section(
        "Events",
        data["events"],
        {
            "TIME": lambda e: stamp(e["time"]),
            "KIND": lambda e: e["kind"],
            "ATTEMPT": lambda e: dash(e["attempt"]),
            "NODE": lambda e: e["node"] or "-",
            "RANK": lambda e: dash(e["rank"]),
            "MESSAGE": lambda e: e["message"],
        },
    )
    _print_script_error(data["events"])
    return 0


def _print_script_error(events: list[dict[str, Any]]) -> None:
    """The traceback of the script error the job failed on (control/script_bug.py)."""
    for e in events:
        traceback = (
            (e.get("data") or {}).get("traceback") if e["kind"] == EventKind.SCRIPT_ERROR else None
        )
        if traceback:
            print("\nScript error (the job was not retried again):")
            for line in str(traceback).splitlines():
                print(f"  {line}")


def _goodput(accounting: dict[str, Any]) -> str:
    """``93.1% (downtime: WorkerCrash 3.2s, startup 2.0s; 4 steps lost)``."""
    goodput = accounting["goodput"]
    if goodput is None:
        return "-"
    parts = [
        f"{cause} {seconds:.1f}s"
        for cause, seconds in sorted(accounting["downtime_seconds"].items(), key=lambda kv: -kv[1])
        if seconds >= 0.05
    ]
    text = f"{goodput:.1%}"
    if parts:
        text += f" (downtime: {', '.join(parts)}; {accounting['lost_steps']} steps lost)"
    return text


def _pids(workers: list[dict[str, int]]) -> str:
    """``1234,1235``: the running workers' pids on their node's host, in rank order."""
    return ",".join(str(w["pid"]) for w in sorted(workers, key=lambda w: w["rank"])) or "-"


def dash(value: object) -> str:
    return "-" if value is None else str(value)


def _section(title: str, items: list[dict[str, Any]], columns: dict[str, Cell]) -> None:
    """``Title:`` and a table of the items, one column a header and how it shows an item."""
    print(f"\n{title}:")
    _table([list(columns)] + [[cell(item) for cell in columns.values()] for item in items], 2)


def _table(rows: list[list[str]], indent: int = 0) -> None:
    """Columns of text; what a worker may have written in a cell (a fault's message, a
    worker event's) is shown with its control characters as escapes."""
    rows = [[safe_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=True)]
        print(" " * indent + "  ".join(cells).rstrip())


def logs(store: Store, ref: str, rank: int | None, follow: bool) -> int:
    job = store.job(ref)
    logs_dir = Path(job.job_dir) / "logs"
    path = logs_dir / (f"rank-{rank}.log" if rank is not None else "console.log")
    if rank is not None and rank >= job.nnodes * job.nproc_per_node:
        print(
            f"trainguard: job {job.id} has ranks 0..{job.nnodes * job.nproc_per_node - 1}, "
            f"not {rank}",
            file=sys.stderr,
        )
        return 2
    if rank is not None and not path.exists():
        if (job.source or "").startswith(JOINED):
            print(
                f"trainguard: rank {rank}'s log is not on this host {job.source}, and the rank "
                f"ran on another host: run trainguard logs {job.id} --rank {rank} on the host "
                "that ran it, or on the controller's host",
                file=sys.stderr,
            )
            return 1
        if (holder := remote_holder(store, job, rank)) is not None:

            def running() -> bool:
                return effective_phase(store.job(job.id)) not in (*TERMINAL_PHASES, "Lost")

            return follow_remote(store, job, rank, holder, follow, running, _write_out)
    # Rotated files first, oldest first (agent/logcap.py: NAME.1 is the newest).
    rotations = [p for p in logs_dir.glob(f"{path.name}.*") if _rotation_index(p)]
    for old in sorted(rotations, key=_rotation_index, reverse=True):
        _copy_out(old, 0)
    offset = 0
    while True:
        if path.exists():
            if path.stat().st_size < offset:  # rotated meanwhile: the old file's rest first
                _copy_out(path.with_name(f"{path.name}.1"), offset)
                offset = 0
            offset += _copy_out(path, offset)
        if not follow or effective_phase(store.job(job.id)) in (*TERMINAL_PHASES, "Lost"):
            if follow and path.exists() and path.stat().st_size > offset:
                continue  # drain what was written while we looked at the phase
            return 0
        time.sleep(FOLLOW_INTERVAL_SECONDS)


def _rotation_index(path: Path) -> int:
    suffix = path.name.rpartition(".")[2]
    return int(suffix) if suffix.isdigit() else 0


def _copy_out(path: Path, offset: int) -> int:
    """Write ``path`` from ``offset`` to stdout; how many bytes (0 if it is gone).

    On a terminal, control characters are shown as escapes (observe/terminal.py); to a
    pipe or a file, the bytes go out as the workers wrote them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return 0
    _write_out(chunk)
    return len(chunk)


def _write_out(chunk: bytes) -> None:
    """Write ``chunk`` to stdout (see :func:`_copy_out`)."""
    if _on_terminal(sys.stdout):
        sys.stdout.write(safe_bytes(chunk))
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(chunk)
    sys.stdout.flush()


def _on_terminal(stream: TextIO) -> bool:
    """A terminal, or a stream that takes only text (no bytes to pass on)."""
    try:
        return stream.isatty() or not hasattr(stream, "buffer")
    except ValueError:  # closed
        return False
