"""CPU used by a launcher's own processes (not its workers) while a job trains.

A :class:`CpuSampler` walks a run's process trees every ``interval`` and keeps each
process's CPU time (user + system, from ``/proc``), sorted into roles: a worker has
``RANK`` in its environment; trainguard's worker template is named by its command line;
everything else is the launcher's own (trainguard's controller and agents, torchrun's
elastic agents). :meth:`CpuSampler.launcher_rate` is the launcher's CPU seconds per
minute between two times (the first and last completed step): its steady cost, without
the interpreters' start-up. It also keeps each worker template's largest memory
(:func:`memory_mib`: resident, proportional and private), one template per node.
"""

from __future__ import annotations

import os
import statistics
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


def memory_mib(pid: int) -> dict[str, float] | None:
    """``rss`` (resident), ``pss`` (shared pages split among their sharers: the template's
    forked workers share most of it) and ``uss`` (private: what its exit would free), in
    MiB, from ``/proc/<pid>/smaps_rollup``; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kib: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            kib[key] = int(parts[0])
    if "Rss" not in kib:
        return None
    private = kib.get("Private_Clean", 0) + kib.get("Private_Dirty", 0)
    return {"rss": kib["Rss"] / 1024, "pss": kib.get("Pss", 0) / 1024, "uss": private / 1024}


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
        self.templates: dict[tuple[int, str], dict[str, float]] = {}  # the largest of each
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

    def template_memory(self) -> dict[str, float] | None:
        """The templates' largest ``rss``/``pss``/``uss`` (MiB), the median over them (one
        per node); None when there was none."""
        if not self.templates:
            return None
        kept = list(self.templates.values())
        return {name: statistics.median(m[name] for m in kept) for name in kept[0]}

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
                # A launcher's process is looked at again each time: a worker seen between
                # its fork and its exec (torchrun's Popen) still has the launcher's command
                # line and environment, and would count as the launcher's for good (one
                # torchrun repetition read 21.6 CPU s/min so).
                kind = known[0] if known and known[0] != LAUNCHER else role(proc.pid)
                self._seen[key] = (kind, cpu)
                if kind == TEMPLATE and (memory := memory_mib(proc.pid)) is not None:
                    kept = self.templates.setdefault(key, memory)
                    for name, mib in memory.items():
                        kept[name] = max(kept[name], mib)
        totals: dict[str, float] = {}
        for kind, cpu in self._seen.values():
            totals[kind] = totals.get(kind, 0.0) + cpu
        self.samples.append((now, totals))
