"""Disk checks: free space, then write / fsync / read back / verify a file, in a directory.

``disk`` runs in the job directory and ``shm`` in ``/dev/shm`` (skipped where there is
none). The file (``.trainguard-health-<pid>-<random>``) is removed whatever happens.
The read comes back from the page cache: this finds I/O errors, a read-only or full
filesystem and corruption on the way, not the disk's read speed. The write speed
includes the fsync.

Why the default thresholds differ: a container's ``/dev/shm`` is 64 MiB unless it is
given more (Docker's and Kubernetes' default), so the ``shm`` default (32 MiB free)
fails only a nearly full one; PyTorch's DataLoader workers need far more, which a job's
spec should ask for.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from trainguard.health.procfs import free_mib
from trainguard.health.result import CheckResult, Evidence

__all__ = ["DEFAULT_DISK_MIN_FREE_MIB", "DEFAULT_SHM_MIN_FREE_MIB", "DirectoryCheck", "shm_check"]

DEFAULT_DISK_MIN_FREE_MIB: Final = 512.0
DEFAULT_SHM_MIN_FREE_MIB: Final = 32.0
SHM: Final = "/dev/shm"
_MIB: Final = 1024 * 1024


@dataclass(frozen=True)
class DirectoryCheck:
    """Fail when ``directory`` has under ``min_free_mib`` free, or a test file does not
    write, sync and read back intact. ``skip_if_missing``: skipped (not failed) where the
    directory does not exist."""

    directory: str
    min_free_mib: float = DEFAULT_DISK_MIN_FREE_MIB
    write_mib: int = 16
    skip_if_missing: bool = False
    timeout: float = 30.0
    name: str = "disk"

    def run(self) -> CheckResult:
        if not os.path.isdir(self.directory):
            if self.skip_if_missing:
                return CheckResult(self.name, "skipped", f"no {self.directory} on this machine")
            return CheckResult(self.name, "failed", f"no such directory: {self.directory}")
        free = free_mib(self.directory)
        evidence: Evidence = {
            "directory": self.directory,
            "free_mib": round(free, 1),
            "min_free_mib": self.min_free_mib,
        }
        if free < self.min_free_mib:
            return CheckResult(
                self.name,
                "failed",
                f"too little free space in {self.directory}: expected minimum "
                f"{self.min_free_mib:g} MiB, got {free:.0f}",
                evidence,
            )
        size = min(self.write_mib, max(int(free) - 1, 0))
        try:
            write_s, read_s = _write_read_verify(Path(self.directory), size)
        except (OSError, _Mismatch) as exc:
            return CheckResult(self.name, "failed", f"{self.directory}: {exc}", evidence)
        evidence["written_mib"] = size
        evidence["write_mb_per_s"] = round(size * _MIB / max(write_s, 1e-9) / 1e6, 1)
        evidence["read_mb_per_s"] = round(size * _MIB / max(read_s, 1e-9) / 1e6, 1)
        return CheckResult(
            self.name,
            "passed",
            f"{free:.0f} MiB free in {self.directory}; wrote and verified {size} MiB "
            f"at {evidence['write_mb_per_s']} MB/s (with fsync)",
            evidence,
        )


def shm_check(min_free_mib: float = DEFAULT_SHM_MIN_FREE_MIB, write_mib: int = 8) -> DirectoryCheck:
    """The ``shm`` check: `DirectoryCheck` on ``/dev/shm``, skipped where there is none."""
    return DirectoryCheck(
        SHM, min_free_mib=min_free_mib, write_mib=write_mib, skip_if_missing=True, name="shm"
    )


class _Mismatch(Exception):
    pass


def _write_read_verify(directory: Path, mib: int) -> tuple[float, float]:
    """(write + fsync seconds, read seconds) of a ``mib`` MiB file, removed afterwards."""
    path = directory / f".trainguard-health-{os.getpid()}-{secrets.token_hex(4)}"
    pattern = secrets.token_bytes(4096) * (_MIB // 4096)
    try:
        start = time.monotonic()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for _ in range(mib):
                view = memoryview(pattern)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        written = time.monotonic()
        with path.open("rb") as file:
            for i in range(mib):
                if file.read(_MIB) != pattern:
                    raise _Mismatch(f"read back differs from what was written, in MiB {i}")
            if file.read(1):
                raise _Mismatch("read back more than was written")
        return written - start, time.monotonic() - written
    finally:
        path.unlink(missing_ok=True)
