"""The signals behind fault injection: kill, stop, kill a node, throttle.

Every target is pinned to one process by its start time (:func:`procs.start_time
<trainguard.platform.procs.start_time>`, taken before the first signal), so no signal,
a throttle's or a final SIGCONT included, reaches a later process reusing the pid.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from trainguard.platform.procs import alive, kill_recorded, pin, runs, start_time

# Throttle duty cycle of a ``slow`` injection: seconds running, then seconds stopped.
DEFAULT_SLOW_RUN_SECONDS = 0.1
DEFAULT_SLOW_STOP_SECONDS = 0.4
# Time close() waits for each throttle thread to resume its process and end.
THROTTLE_JOIN_SECONDS = 2.0


class _Process:
    """A pid pinned to one process: its start time tells it from a later one reusing the pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = start_time(pid)

    def alive(self) -> bool:
        """True while this very process exists and is not a zombie."""
        if self.start is None:  # gone when pinned, or no /proc to tell one from another
            return not os.path.isdir("/proc") and alive(self.pid)
        return runs(self.pid, self.start)

    def send(self, sig: signal.Signals) -> bool:
        """Send ``sig`` if the process still lives; False when it is gone."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


class _Throttle:
    """A daemon thread alternating SIGSTOP/SIGCONT until halted or the process is gone."""

    def __init__(self, process: _Process, run_seconds: float, stop_seconds: float) -> None:
        self.process = process
        self._run_seconds = run_seconds
        self._stop_seconds = stop_seconds
        self._halt = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"inject-slow-{process.pid}"
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._halt.is_set():
                if not self.process.send(signal.SIGSTOP):
                    return
                self._halt.wait(self._stop_seconds)
                if not self.process.send(signal.SIGCONT):
                    return
                self._halt.wait(self._run_seconds)
        finally:
            self.process.send(signal.SIGCONT)

    def halt(self, timeout: float) -> None:
        self._halt.set()
        self._thread.join(timeout)
        self.process.send(signal.SIGCONT)  # even if the thread did not end in time


class SignalActuator:
    """The real actuator: signals to real processes, one thread per throttled worker."""

    def __init__(
        self,
        slow_run_seconds: float = DEFAULT_SLOW_RUN_SECONDS,
        slow_stop_seconds: float = DEFAULT_SLOW_STOP_SECONDS,
        join_seconds: float = THROTTLE_JOIN_SECONDS,
    ) -> None:
        if slow_run_seconds <= 0 or slow_stop_seconds <= 0:
            raise ValueError(
                f"slow duty cycle must be positive, got run {slow_run_seconds} s, "
                f"stop {slow_stop_seconds} s"
            )
        self._run_seconds = slow_run_seconds
        self._stop_seconds = slow_stop_seconds
        self._join_seconds = join_seconds
        self._lock = threading.Lock()
        self._stopped: list[_Process] = []
        self._throttles: list[_Throttle] = []

    @property
    def throttled_pids(self) -> list[int]:
        """Pids whose throttle thread is still running."""
        with self._lock:
            return [t.process.pid for t in self._throttles if t.running]

    def kill(self, pid: int) -> bool:
        return _Process(pid).send(signal.SIGKILL)

    def stop(self, pid: int) -> bool:
        process = _Process(pid)
        if not process.send(signal.SIGSTOP):
            return False
        with self._lock:
            self._stopped.append(process)
        return True

    def kill_node(self, agent_pid: int, worker_pids: Sequence[int]) -> bool:
        # Every pid is pinned before the first signal: the workers die with their agent,
        # and a pid freed then could be reused before its turn comes.
        pinned = pin((agent_pid, *worker_pids))
        if not runs(agent_pid, pinned[agent_pid]):
            return False
        for pid, started in pinned.items():
            kill_recorded(pid, started)  # its group, and itself if it does not lead one
        return True

    def throttle(self, pid: int) -> bool:
        process = _Process(pid)
        if not process.alive():
            return False
        with self._lock:
            self._throttles.append(_Throttle(process, self._run_seconds, self._stop_seconds))
        return True

    def close(self) -> None:
        with self._lock:
            throttles, self._throttles = self._throttles, []
            stopped, self._stopped = self._stopped, []
        for throttle in throttles:
            throttle.halt(self._join_seconds)
        for process in stopped:
            process.send(signal.SIGCONT)


def write_hook(directory: Path, kind: str, code: int | None = None) -> bool:
    """Act on a node agent's rehearsal hooks (``agent/health.py``): ``xid`` appends a
    kernel-log-style XID line to ``directory/kernel.log``, ``disk-full`` creates
    ``directory/disk-full``. False when the directory cannot be written."""
    from trainguard.agent.health import HOOK_DISK_FULL, HOOK_KERNEL_LOG
    from trainguard.health.xid import xid_line

    try:
        directory.mkdir(parents=True, exist_ok=True)
        if kind == "xid":
            with open(directory / HOOK_KERNEL_LOG, "a", encoding="utf-8") as log:
                log.write(xid_line(code or 79) + "\n")
        elif kind == "disk-full":
            (directory / HOOK_DISK_FULL).touch()
        else:
            raise ValueError(f"no hook for {kind!r}")
    except OSError:
        return False
    return True
