"""CPU and memory checks: a short, bounded stress run in the agent's own process.

- ``cpu``: every usable core hashes (SHA-256 over 64 KiB blocks; hashlib lets go of the
  GIL on blocks that size) for ``seconds``; the evidence is the throughput. It fails only
  under ``min_mb_per_s`` (0 by default: report only), so a floor must come from a
  measurement on a healthy node of the same type.
- ``memory``: ``mib`` MiB are written and read back in three patterns (0xA5, 0x5A, and a
  different pattern in every MiB so that aliased addresses show); MemAvailable is
  reported and checked against ``min_available_mib``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Final

from trainguard.health.procfs import mem_available_mib, read_meminfo
from trainguard.health.result import CheckResult, Evidence

__all__ = ["CpuCheck", "MemoryCheck"]

_BLOCK: Final = b"\x5a" * (64 * 1024)
_MIB: Final = 1024 * 1024


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuCheck:
    """Hash on every usable core for ``seconds``; fail under ``min_mb_per_s`` in total."""

    seconds: float = 0.5
    min_mb_per_s: float = 0.0
    threads: int | None = None
    timeout: float = 10.0
    name: str = "cpu"

    def run(self) -> CheckResult:
        threads = self.threads or _usable_cores()
        counts = [0] * threads
        deadline = time.monotonic() + self.seconds

        def spin(slot: int) -> None:
            digest = hashlib.sha256
            done = 0
            while time.monotonic() < deadline:
                digest(_BLOCK).digest()
                done += 1
            counts[slot] = done

        start = time.monotonic()
        workers = [threading.Thread(target=spin, args=(i,), daemon=True) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        elapsed = max(time.monotonic() - start, 1e-9)
        mb_per_s = sum(counts) * len(_BLOCK) / elapsed / 1e6
        evidence: Evidence = {
            "threads": threads,
            "hashes": sum(counts),
            "mb_per_s": round(mb_per_s, 1),
            "min_mb_per_s": self.min_mb_per_s,
        }
        summary = f"sha256 {mb_per_s:.0f} MB/s on {threads} thread(s) in {elapsed:.2f} s"
        if mb_per_s < self.min_mb_per_s:
            return CheckResult(
                self.name,
                "failed",
                f"CPU too slow: expected minimum {self.min_mb_per_s:g} MB/s, got {mb_per_s:.0f}",
                evidence,
            )
        return CheckResult(self.name, "passed", summary, evidence)


@dataclass(frozen=True)
class MemoryCheck:
    """Write and verify ``mib`` MiB; fail under ``min_available_mib`` MemAvailable."""

    mib: int = 64
    min_available_mib: float = 0.0
    timeout: float = 30.0
    name: str = "memory"

    def run(self) -> CheckResult:
        available = mem_available_mib(read_meminfo())
        evidence: Evidence = {
            "tested_mib": self.mib,
            "mem_available_mib": None if available is None else round(available),
            "min_available_mib": self.min_available_mib,
        }
        if available is not None and available < max(self.min_available_mib, self.mib):
            needed = max(self.min_available_mib, self.mib)
            return CheckResult(
                self.name,
                "failed",
                f"too little memory available: expected minimum {needed:g} MiB, "
                f"got {available:.0f}",
                evidence,
            )
        start = time.monotonic()
        bad = _pattern_test(self.mib)
        elapsed = max(time.monotonic() - start, 1e-9)
        evidence["mb_per_s"] = round(3 * 2 * self.mib * _MIB / elapsed / 1e6, 1)
        if bad is not None:
            evidence["bad_mib"] = bad
            return CheckResult(
                self.name,
                "failed",
                f"memory pattern mismatch in MiB {bad} of {self.mib}",
                evidence,
            )
        shown = "?" if available is None else f"{available:.0f}"
        return CheckResult(
            self.name,
            "passed",
            f"{self.mib} MiB written and verified in 3 patterns; MemAvailable {shown} MiB",
            evidence,
        )


def _numbered(i: int) -> bytes:
    """A MiB whose content depends on ``i``: a write to the wrong MiB shows."""
    return hashlib.sha256(i.to_bytes(8, "little")).digest() * (_MIB // 32)


def _pattern_test(mib: int) -> int | None:
    """The first MiB that did not read back as written, or None."""
    buffer = bytearray(mib * _MIB)
    view = memoryview(buffer)
    try:
        for fill in (b"\xa5", b"\x5a"):
            chunk = fill * _MIB
            for i in range(mib):
                view[i * _MIB : (i + 1) * _MIB] = chunk
            for i in range(mib):
                if view[i * _MIB : (i + 1) * _MIB] != chunk:
                    return i
        for i in range(mib):
            view[i * _MIB : (i + 1) * _MIB] = _numbered(i)
        for i in range(mib):
            if view[i * _MIB : (i + 1) * _MIB] != _numbered(i):
                return i
        return None
    finally:
        view.release()
