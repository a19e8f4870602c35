"""Node health: deep checks before a node takes ranks, monitors while it works (no torch
import here: the checks that need torch run it in a child process).

- `result`: `CheckResult` (an on-start check's verdict) and `Finding` (a fault a monitor
  saw, asking for ``replace`` or ``reboot``), JSON-able;
- `runner`: `HealthCheck` (a name, a timeout, ``run()``) and `run_checks` (bounded,
  with forced failures for rehearsals);
- checks: `stress` (``cpu``, ``memory``), `storage` (``disk``, ``shm``), `gpu` (dcgmi
  diag or `gpu_probe`), `connectivity` (an all-reduce between nodes, `bandwidth`);
- monitors: `kernel_log` (XID/NVRM lines, table in `xid`), `nvsmi` (GPU count, ECC),
  `monitors` (free space, memory pressure, `HealthWatch` running them all);
- `suite`: the defaults and the assembled suite; `command`: ``trainguard health-check``.
"""

from trainguard.health.connectivity import ConnectivityCheck
from trainguard.health.gpu import GpuCheck
from trainguard.health.kernel_log import (
    KERNEL_LOG_ENV,
    FileSource,
    KernelLogMonitor,
    KmsgSource,
    default_sources,
)
from trainguard.health.monitors import (
    HealthWatch,
    Latch,
    MemoryPressureMonitor,
    Monitor,
    SpaceMonitor,
)
from trainguard.health.nvsmi import NvidiaSmiMonitor
from trainguard.health.result import (
    NODE_HEALTH_STATUS,
    Action,
    CheckResult,
    Evidence,
    Finding,
    FindingKind,
    Outcome,
)
from trainguard.health.runner import HealthCheck, run_check, run_checks
from trainguard.health.storage import DirectoryCheck, shm_check
from trainguard.health.stress import CpuCheck, MemoryCheck
from trainguard.health.suite import (
    CHECK_NAMES,
    HYPERPOD_ALIASES,
    MONITOR_KINDS,
    Peers,
    SuiteConfig,
    continuous_watch,
    expand_check_names,
    on_start_checks,
    set_disk_full,
)
from trainguard.health.xid import xid_line

__all__ = [
    "CHECK_NAMES",
    "HYPERPOD_ALIASES",
    "KERNEL_LOG_ENV",
    "MONITOR_KINDS",
    "NODE_HEALTH_STATUS",
    "Action",
    "CheckResult",
    "ConnectivityCheck",
    "CpuCheck",
    "DirectoryCheck",
    "Evidence",
    "FileSource",
    "Finding",
    "FindingKind",
    "GpuCheck",
    "HealthCheck",
    "HealthWatch",
    "KernelLogMonitor",
    "KmsgSource",
    "Latch",
    "MemoryCheck",
    "MemoryPressureMonitor",
    "Monitor",
    "NvidiaSmiMonitor",
    "Outcome",
    "Peers",
    "SpaceMonitor",
    "SuiteConfig",
    "continuous_watch",
    "default_sources",
    "expand_check_names",
    "on_start_checks",
    "run_check",
    "run_checks",
    "set_disk_full",
    "shm_check",
    "xid_line",
]
