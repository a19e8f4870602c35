"""GPU count and ECC errors through ``nvidia-smi`` (`NvidiaSmiMonitor`).

Each poll runs ``nvidia-smi --query-gpu=index,pci.bus_id,uuid,
ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits`` (bounded by
``timeout``). Findings:

- ``GpuCount`` (``replace``): fewer GPUs answer than ``expected_gpus``; nvidia-smi
  failing or hanging counts the GPUs it did list (a GPU that fell off the bus often
  makes it fail or hang);
- ``Ecc`` (``reboot``): a GPU with uncorrected ECC errors since the driver was loaded
  (the volatile counter; a reset or reboot clears it, and applies a pending row remap).

Where nvidia-smi is not installed the monitor finds nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from functools import partial
from typing import Final

from trainguard.health.monitors import Latch
from trainguard.health.result import Evidence, Finding
from trainguard.health.subproc import run_bounded

__all__ = ["QUERY", "GpuRow", "NvidiaSmiMonitor", "parse_query"]

QUERY: Final = "index,pci.bus_id,uuid,ecc.errors.uncorrected.volatile.total"


@dataclass(frozen=True)
class GpuRow:
    """One GPU as nvidia-smi lists it; ``uncorrected_ecc`` None where not reported."""

    index: int
    pci: str
    uuid: str
    uncorrected_ecc: int | None


def parse_query(text: str) -> list[GpuRow]:
    """The rows of `QUERY`'s CSV output; lines that do not parse are left out."""
    rows = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            index = int(fields[0])
        except ValueError:
            continue
        try:
            ecc: int | None = int(fields[3])
        except ValueError:
            ecc = None  # "[N/A]", "[Not Supported]", "[GPU requires reset]"
        rows.append(GpuRow(index, fields[1], fields[2], ecc))
    return rows


class NvidiaSmiMonitor:
    """GPU count against ``expected_gpus`` (None: not checked) and uncorrected ECC errors."""

    name = "nvidia-smi"

    def __init__(
        self,
        expected_gpus: int | None = None,
        nvidia_smi: str | None = None,
        interval: float = 10.0,
        timeout: float = 10.0,
    ) -> None:
        self.expected_gpus = expected_gpus
        self.nvidia_smi = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
        self.interval = interval
        self.timeout = timeout
        self._latch = Latch()

    def poll(self, now: float) -> list[Finding]:
        if self.nvidia_smi is None:
            return []
        argv = [self.nvidia_smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
        done = run_bounded(argv, self.timeout)
        rows = parse_query(done.stdout)
        problem = None
        if done.timed_out:
            problem = f"nvidia-smi did not answer in {self.timeout:g} s"
        elif done.returncode != 0:
            problem = f"nvidia-smi failed (exit {done.returncode}): {done.tail()}"
        findings = self._count(rows, problem, now)
        for row in rows:
            active = bool(row.uncorrected_ecc)
            findings += self._latch.update(f"ecc:{row.uuid}", active, partial(_ecc, row, now))
        return findings

    def _count(self, rows: list[GpuRow], problem: str | None, now: float) -> list[Finding]:
        expected = self.expected_gpus
        missing = expected is not None and len(rows) < expected
        evidence: Evidence = {
            "expected_gpus": expected,
            "gpu_count": len(rows),
            "pci": [row.pci for row in rows],
            "error": problem,
        }
        detail = f" ({problem})" if problem else ""
        message = f"GPU count: expected {expected}, got {len(rows)}{detail}"
        return self._latch.update(
            "count", missing, lambda: Finding("GpuCount", "replace", message, evidence, now)
        )


def _ecc(row: GpuRow, now: float) -> Finding:
    message = (
        f"GPU {row.index} ({row.pci}): {row.uncorrected_ecc} uncorrected ECC error(s) "
        "since the driver was loaded"
    )
    evidence: Evidence = {
        "index": row.index,
        "pci": row.pci,
        "uuid": row.uuid,
        "uncorrected_ecc": row.uncorrected_ecc,
    }
    return Finding("Ecc", "reboot", message, evidence, now)
