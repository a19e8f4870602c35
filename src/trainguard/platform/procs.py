"""Small process helpers shared by the local platform's pieces.

A pid kept for later (in the store, for ``delete``; a worker pid learnt from an agent's
status, for a shutdown or a node kill) is kept with its start time (:func:`start_time`),
taken when the pid is first seen (:func:`pin`), and signalled only through
:func:`kill_recorded`, which first checks that the pid still names that process: a
later, unrelated process that reuses the pid is never signalled.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import socket
from collections.abc import Iterable, Mapping

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (agents and workers each lead their own).

    Only for a pid that cannot have been reused (a child of this process not yet
    reaped); any other pid goes through :func:`kill_recorded` with its start time.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def alive(pid: int | None) -> bool:
    """True when a process with this pid exists (it may belong to another user)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_time(pid: int | None) -> str | None:
    """When the process with this pid started: ``"<boot id>:<clock ticks since boot>"``.

    Field 22 of ``/proc/<pid>/stat``, with the boot id, tells the process from any later
    one that reuses its pid, in this boot or a later one. None when no process has the
    pid, or where there is no ``/proc`` to ask.
    """
    stat = proc_stat(pid)
    return None if stat is None else f"{_boot_id()}:{stat[1]}"


def pin(
    pids: Iterable[int], known: Mapping[int, str | None] | None = None
) -> dict[int, str | None]:
    """Each of ``pids`` with its start time: the one in ``known`` (taken when the pid was
    first seen), else read now. A pid whose process was gone when first seen keeps None,
    so a process that reuses it later is never signalled."""
    known = known or {}
    return {pid: known[pid] if pid in known else start_time(pid) for pid in pids}


def is_recorded(pid: int | None, started: str | None) -> bool:
    """True when ``pid`` still names the process recorded with start time ``started``
    (running, or a zombie not yet reaped); False when it is gone, its pid was reused,
    or no start time was recorded."""
    return bool(pid) and started is not None and start_time(pid) == started


def runs(pid: int | None, started: str | None) -> bool:
    """True when the process recorded as ``pid`` started at ``started`` still runs
    (a zombie does not)."""
    stat = proc_stat(pid)
    return (
        stat is not None
        and started is not None
        and stat[0] not in "ZXx"
        and f"{_boot_id()}:{stat[1]}" == started
    )


def kill_recorded(pid: int | None, started: str | None, group: bool = True) -> bool:
    """SIGKILL the process recorded as ``pid`` started at ``started`` (and, with
    ``group``, the process group it leads); returns whether it was signalled.

    Nothing is signalled unless the pid's start time now is the recorded one: a dead
    process is skipped, and so is a pid reused by another process or recorded without
    a start time. The single process is signalled through a pidfd opened before the
    check, so it cannot be another process by then. The group is signalled by its id
    (the leader's pid) right after the check; a group outlives its leader's check only
    if the leader dies and its pid is reused as a new group's id in between.
    """
    if not pid or started is None:
        return False
    pidfd = _pidfd(pid)
    try:
        if start_time(pid) != started:
            return False
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``'s process now, where Linux has them (5.3 and later)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def proc_stat(pid: int | None) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) from ``/proc/<pid>/stat``."""
    fields = _stat_fields(pid)
    try:
        return (fields[0], int(fields[19])) if fields else None
    except (IndexError, ValueError):
        return None


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system, every thread) ``pid`` has used, from ``/proc/<pid>/stat``."""
    fields = _stat_fields(pid)
    try:
        return (int(fields[11]) + int(fields[12])) / _clock_ticks() if fields else None
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int | None) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the name (the state letter first), or None."""
    if not pid or pid < 0:
        return None
    try:  # os.open, not open(): a status poll reads one per worker (a third of the cost)
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096).decode("ascii", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    return raw[raw.rfind(")") + 2 :].split()  # the name in parentheses may hold spaces


@functools.cache
def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


@functools.cache
def _boot_id() -> str:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


CONTROLLER_GC_THRESHOLDS = (20_000, 20, 10)
"""Young-generation thresholds for a controller process (Python's defaults: 700, 10, 10)."""


def tune_gc_for_a_controller() -> None:
    """Collect the young generations less often in a controller process.

    A controller keeps every agent's newest status (dozens of small objects each) and
    replaces them all every poll cycle. With Python's default thresholds those objects
    survive two young collections before they are replaced, reach the old generation,
    and a full collection follows nearly every cycle: 0.2 s each with 4096 nodes, half
    the controller's CPU. Collected less often, most die young and cost nothing.
    """
    gen0, gen1, gen2 = gc.get_threshold()
    want0, want1, want2 = CONTROLLER_GC_THRESHOLDS
    gc.set_threshold(max(gen0, want0), max(gen1, want1), max(gen2, want2))
