"""Reading the machine's state: ``/proc/meminfo``, ``/proc/pressure/memory``, free space.

Parsers take text (so tests feed them any content); readers return None where the file
is missing (no PSI on kernels before 4.20 or with ``psi=0``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

__all__ = [
    "MEMINFO",
    "PSI_MEMORY",
    "free_mib",
    "mem_available_mib",
    "parse_meminfo",
    "parse_psi",
    "read_meminfo",
    "read_psi",
]

MEMINFO: Final = Path("/proc/meminfo")
PSI_MEMORY: Final = Path("/proc/pressure/memory")
_MIB: Final = 1024 * 1024


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as name -> bytes (``MemAvailable:  123 kB`` -> 125952)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        try:
            number = int(fields[0])
        except ValueError:
            continue
        unit = fields[1].lower() if len(fields) > 1 else ""
        values[name.strip()] = number * 1024 if unit == "kb" else number
    return values


def read_meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """This machine's meminfo in bytes; empty where it cannot be read."""
    try:
        return parse_meminfo(path.read_text())
    except OSError:
        return {}


def mem_available_mib(meminfo: dict[str, int]) -> float | None:
    """MemAvailable in MiB, or None where the kernel does not report it."""
    available = meminfo.get("MemAvailable")
    return None if available is None else available / _MIB


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """A pressure file (``some avg10=1.50 avg60=0.20 avg300=0.00 total=123``) as
    ``{"some": {"avg10": 1.5, ...}, "full": {...}}``; malformed fields are left out."""
    result: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.split():
            continue
        kind, *pairs = line.split()
        row: dict[str, float] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                continue
            try:
                row[key] = float(value)
            except ValueError:
                continue
        result[kind] = row
    return result


def read_psi(path: Path = PSI_MEMORY) -> dict[str, dict[str, float]] | None:
    """The parsed pressure file, or None where the kernel has none."""
    try:
        return parse_psi(path.read_text())
    except OSError:
        return None


def free_mib(path: str | os.PathLike[str]) -> float:
    """Space an unprivileged writer may still use on ``path``'s filesystem, in MiB."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize / _MIB
