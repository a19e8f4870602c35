"""Python stacks of stuck workers, for the evidence of a hang.

Each worker is dumped with ``py-spy dump --pid P`` (in parallel, each bounded by the
timeout). py-spy normally pauses the target while it reads it; that fails on a
process that is already stopped (SIGSTOP: state T), so a stopped worker is read with
``--nonblocking`` (its memory is read without pausing it; safe, since it does not
run). The process is never continued. Every text starts with the process state from
``/proc/<pid>/stat`` and its ``wchan``, so a stopped or zombie rank shows as such
even when no stack can be read.

py-spy needs ptrace rights on the worker: same user and Yama ``ptrace_scope`` <= 0,
or root / CAP_SYS_PTRACE (in a container: ``securityContext.capabilities.add:
[SYS_PTRACE]``). Without them the text says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final, NamedTuple

__all__ = ["DEFAULT_STACKS_TIMEOUT", "capture_stacks", "find_py_spy", "process_state"]

DEFAULT_STACKS_TIMEOUT: Final = 10.0
"""Seconds allowed for all dumps together (they run in parallel)."""

_STATES: Final = {
    "R": "running",
    "S": "sleeping",
    "D": "disk sleep",
    "T": "stopped",
    "t": "tracing stop",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
    "P": "parked",
}
_STOPPED: Final = frozenset("Tt")
_MAX_OUTPUT_CHARS: Final = 64 * 1024


def find_py_spy() -> str | None:
    """The py-spy binary: next to this interpreter (a venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def process_state(pid: int) -> tuple[str | None, str]:
    """(state letter or None, a one-line description from /proc/<pid>/stat and wchan)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None, f"pid {pid}: no such process (exited?)"
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ")".
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    letter = fields[0] if fields else "?"
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except OSError:
        wchan = "?"
    meaning = _STATES.get(letter, "unknown")
    return letter, f"pid {pid} ({comm}): state {letter} ({meaning}), wchan {wchan}"


def capture_stacks(
    pids: Mapping[int, int], timeout: float = DEFAULT_STACKS_TIMEOUT
) -> dict[int, str]:
    """rank -> text: process state line, then the Python stacks (or why there are none).

    Never raises; returns within about ``timeout`` seconds.
    """
    if not pids:
        return {}
    spy = find_py_spy()
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=len(pids), thread_name_prefix="trainguard-stacks") as ex:
        futures = {rank: ex.submit(_capture, pid, spy, deadline) for rank, pid in pids.items()}
        out: dict[int, str] = {}
        for rank, future in futures.items():
            try:
                out[rank] = future.result()
            except Exception as err:  # never raise: evidence is best effort
                out[rank] = f"pid {pids[rank]}: stack capture failed: {err!r}"
    return out


def _capture(pid: int, spy: str | None, deadline: float) -> str:
    letter, header = process_state(pid)
    if letter is None:
        return header
    if spy is None:
        return f"{header}\n(py-spy not found: install py-spy to capture Python stacks)"
    if letter in "ZX":
        return f"{header}\n(no stacks: the process has exited)"
    nonblocking = letter in _STOPPED
    text = _dump(spy, pid, deadline, nonblocking)
    if text.ok or nonblocking:
        return f"{header}\n{text.body}"
    # it may have been stopped meanwhile, or refuse to be paused: read without pausing
    retry = _dump(spy, pid, deadline, nonblocking=True)
    if retry.ok:
        return f"{header}\n{retry.body}"
    return f"{header}\n{text.body}"


class _Dump(NamedTuple):
    ok: bool
    body: str


def _dump(spy: str, pid: int, deadline: float, nonblocking: bool) -> _Dump:
    left = deadline - time.monotonic()
    if left <= 0:
        return _Dump(False, "(py-spy: no time left for a dump)")
    argv = [spy, "dump", "--pid", str(pid)]
    if nonblocking:
        argv.append("--nonblocking")
    note = "py-spy --nonblocking (the process is stopped)" if nonblocking else "py-spy"
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=left, check=False
        )
    except subprocess.TimeoutExpired:
        return _Dump(False, f"({note}: no answer within the timeout)")
    except OSError as err:
        return _Dump(False, f"({note} could not run: {err})")
    if done.returncode == 0 and done.stdout.strip():
        return _Dump(True, f"[{note}]\n{done.stdout.rstrip()[:_MAX_OUTPUT_CHARS]}")
    error = (done.stderr.strip() or done.stdout.strip()).splitlines()
    # py-spy's error is its first lines; the rest is a Rust backtrace
    summary = " / ".join(line.strip() for line in error[:4] if line.strip())
    return _Dump(False, f"({note} failed, exit {done.returncode}: {summary})")
