"""CPU used by a launcher's own processes (not its workers) while a job trains.

A :class:`CpuSampler` walks a run's process trees every ``interval`` and keeps each
process's CPU time (user + system, from ``/proc``), sorted into roles: a worker has
``RANK`` in its environment; trainguard's worker template is named by its command line;
everything else is the launcher's own (trainguard's controller and agents, torchrun's
elastic agents). :meth:`CpuSampler.launcher_rate` is the launcher's CPU seconds per
minute between two times (the first and last completed step): its steady cost, without
the interpreters' start-up.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.runs import _environ, _stat, process_tree

TICKS = os.sysconf("SC_CLK_TCK")
LAUNCHER, TEMPLATE, WORKER = "launcher", "template", "worker"


def role(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if "RANK" in _environ(pid):
        return WORKER
    if b"trainguard.agent.template" in cmdline:
        return TEMPLATE
    return LAUNCHER


def cpu_seconds(pid: int) -> float | None:
    fields = _stat(pid)
    if fields is None or len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


class CpuSampler:
    """Samples the CPU of ``roots()``'s process trees in a thread until stopped."""

    def __init__(self, roots: Callable[[], Sequence[int]], interval: float = 0.2) -> None:
        self._roots = roots
        self._interval = interval
        self._seen: dict[tuple[int, str], tuple[str, float]] = {}  # (pid, start) -> role, cpu
        self.samples: list[tuple[float, dict[str, float]]] = []  # time -> CPU s by role
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(5.0)

    def launcher_rate(self, start: float, end: float) -> float | None:
        """The launcher's CPU seconds per minute of wall time within [start, end]."""
        inside = [(t, by_role) for t, by_role in self.samples if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] <= 0:
            return None
        (t0, first), (t1, last) = inside[0], inside[-1]
        return (last.get(LAUNCHER, 0.0) - first.get(LAUNCHER, 0.0)) / (t1 - t0) * 60.0

    def _run(self) -> None:
        while not self._halt.is_set():
            self._sample()
            self._halt.wait(self._interval)

    def _sample(self) -> None:
        now = time.time()
        for root in self._roots():
            for proc in process_tree(root):
                cpu = cpu_seconds(proc.pid)
                if cpu is None:
                    continue
                key = (proc.pid, proc.started)
                known = self._seen.get(key)
                self._seen[key] = (known[0] if known else role(proc.pid), cpu)
        totals: dict[str, float] = {}
        for kind, cpu in self._seen.values():
            totals[kind] = totals.get(kind, 0.0) + cpu
        self.samples.append((now, totals))
