"""Continuous monitors: what the agent runs while its node works, and `HealthWatch`,
which runs them.

A monitor has a ``name``, an ``interval`` (seconds between looks) and ``poll(now) ->
list[Finding]``: the findings that are new since its last poll. A condition (a full
disk, memory pressure, a missing GPU) is reported once when it starts (`Latch`), and
again only after it has cleared and come back; no floods.

Here: `SpaceMonitor` (free space on a directory), `MemoryPressureMonitor`. Elsewhere:
`trainguard.health.kernel_log.KernelLogMonitor` (XID/NVRM lines),
`trainguard.health.nvsmi.NvidiaSmiMonitor` (GPU count, ECC).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol

from trainguard.health.procfs import PSI_MEMORY, free_mib, read_meminfo, read_psi
from trainguard.health.result import Action, Evidence, Finding

__all__ = [
    "DEFAULT_MIN_AVAILABLE_FRACTION",
    "DEFAULT_PSI_SOME_AVG10",
    "HealthWatch",
    "Latch",
    "MemoryPressureMonitor",
    "Monitor",
    "SpaceMonitor",
]

DEFAULT_PSI_SOME_AVG10: Final = 40.0
"""Percent of the last 10 s in which some task stalled on memory (PSI ``some avg10``)."""
DEFAULT_MIN_AVAILABLE_FRACTION: Final = 0.02
"""MemAvailable / MemTotal under which memory is short."""


class Monitor(Protocol):
    """One thing watched on a running node."""

    @property
    def name(self) -> str: ...

    @property
    def interval(self) -> float:
        """Seconds between two polls."""
        ...

    def poll(self, now: float) -> list[Finding]:
        """New findings; ``now`` is the wall-clock time (Unix seconds) they carry."""
        ...


class Latch:
    """Report a condition once per episode: when it starts, not while it lasts."""

    def __init__(self) -> None:
        self._active: set[str] = set()

    def update(self, key: str, active: bool, finding: Callable[[], Finding]) -> list[Finding]:
        """``[finding()]`` when ``key`` turns active, else ``[]``; inactive re-arms it."""
        if not active:
            self._active.discard(key)
            return []
        if key in self._active:
            return []
        self._active.add(key)
        return [finding()]

    @property
    def active(self) -> frozenset[str]:
        return frozenset(self._active)


class SpaceMonitor:
    """A ``DiskSpace`` finding when ``directory`` has under ``min_free_mib`` free.

    ``forced_full`` (set by ``--inject disk-full``) makes it report the directory full
    whatever its real free space, with ``evidence["injected"] = True``; setting it back
    to False clears the condition. A directory that does not exist is not watched.
    """

    def __init__(
        self,
        directory: str,
        min_free_mib: float,
        action: Action = "replace",
        interval: float = 5.0,
    ) -> None:
        self.directory = directory
        self.min_free_mib = min_free_mib
        self.action: Action = action
        self.interval = interval
        self.forced_full = False
        self.name = f"space:{directory}"
        self._latch = Latch()

    def poll(self, now: float) -> list[Finding]:
        injected = self.forced_full
        try:
            free = 0.0 if injected else free_mib(self.directory)
        except OSError:
            return self._latch.update(self.directory, False, _never)
        evidence: Evidence = {
            "directory": self.directory,
            "free_mib": round(free, 1),
            "min_free_mib": self.min_free_mib,
        }
        if injected:
            evidence["injected"] = True
        cause = " (injected: disk-full)" if injected else ""
        message = (
            f"{self.directory}: {free:.0f} MiB free, under the minimum of "
            f"{self.min_free_mib:g} MiB{cause}"
        )
        low = free < self.min_free_mib
        return self._latch.update(
            self.directory,
            low,
            lambda: Finding("DiskSpace", self.action, message, evidence, now),
        )


class MemoryPressureMonitor:
    """A ``MemoryPressure`` finding (action ``reboot``: what a reboot frees, a leak or an
    orphaned process, is the usual cause) when PSI ``some avg10`` reaches ``psi_some_avg10``
    percent, or MemAvailable falls under ``min_available_fraction`` of MemTotal."""

    name = "memory-pressure"

    def __init__(
        self,
        psi_some_avg10: float = DEFAULT_PSI_SOME_AVG10,
        min_available_fraction: float = DEFAULT_MIN_AVAILABLE_FRACTION,
        interval: float = 5.0,
        proc: Path = Path("/proc"),
    ) -> None:
        self.psi_some_avg10 = psi_some_avg10
        self.min_available_fraction = min_available_fraction
        self.interval = interval
        self._meminfo = proc / "meminfo"
        self._psi = proc / PSI_MEMORY.relative_to("/proc")
        self._latch = Latch()

    def poll(self, now: float) -> list[Finding]:
        psi = read_psi(self._psi)
        some = psi.get("some", {}).get("avg10") if psi else None
        meminfo = read_meminfo(self._meminfo)
        total, available = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
        fraction = available / total if total and available is not None else None
        reasons = []
        if some is not None and some >= self.psi_some_avg10:
            reasons.append(f"tasks stalled on memory {some:g}% of the last 10 s")
        if fraction is not None and fraction < self.min_available_fraction:
            reasons.append(f"only {fraction:.1%} of memory available")
        evidence: Evidence = {
            "psi_some_avg10": some,
            "available_fraction": None if fraction is None else round(fraction, 4),
            "psi_threshold": self.psi_some_avg10,
            "min_available_fraction": self.min_available_fraction,
        }
        message = "memory pressure: " + "; ".join(reasons)
        return self._latch.update(
            "memory",
            bool(reasons),
            lambda: Finding("MemoryPressure", "reboot", message, evidence, now),
        )


class HealthWatch:
    """The node's monitors, each polled when its interval is due.

    Call `poll` often (every second or so) from a thread of its own: a monitor may take
    a few seconds (nvidia-smi). A monitor that raises is skipped for that round and its
    error kept in ``errors`` (name -> message) until it next succeeds.
    """

    def __init__(
        self, monitors: Sequence[Monitor], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.monitors = list(monitors)
        self.errors: dict[str, str] = {}
        self._clock = clock
        self._due: dict[int, float] = {}

    def poll(self, now: float | None = None) -> list[Finding]:
        """New findings from every monitor that is due; ``now`` (wall-clock Unix seconds,
        default the current time) is the time they carry. Intervals follow ``clock``
        (monotonic), so a wall clock set back does not stop the monitors."""
        wall = time.time() if now is None else now
        tick = self._clock()
        findings: list[Finding] = []
        for i, monitor in enumerate(self.monitors):
            if tick < self._due.get(i, tick):
                continue
            self._due[i] = tick + monitor.interval
            try:
                findings.extend(monitor.poll(wall))
            except Exception as exc:  # one broken monitor must not blind the others
                self.errors[monitor.name] = f"{type(exc).__name__}: {exc}"
            else:
                self.errors.pop(monitor.name, None)
        return findings

    def close(self) -> None:
        """Let go of what the monitors hold open (``/dev/kmsg``)."""
        for monitor in self.monitors:
            close = getattr(monitor, "close", None)
            if callable(close):
                close()


def _never() -> Finding:
    raise AssertionError("an inactive condition makes no finding")
