"""The node's health suite, assembled: which on-start checks with which thresholds, and
the continuous monitors. The defaults are here, in one place.

Check names: ``cpu``, ``memory``, ``disk``, ``shm``, ``gpu``, ``connectivity``.
HyperPod's ``OnStartDeepHealthChecks`` names are aliases (`HYPERPOD_ALIASES`):
``InstanceStress`` is every check but ``connectivity``; ``InstanceConnectivity`` is
``connectivity``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from trainguard.health.connectivity import ConnectivityCheck
from trainguard.health.gpu import GpuCheck
from trainguard.health.kernel_log import KernelLogMonitor, default_sources
from trainguard.health.monitors import HealthWatch, MemoryPressureMonitor, Monitor, SpaceMonitor
from trainguard.health.nvsmi import NvidiaSmiMonitor
from trainguard.health.runner import HealthCheck
from trainguard.health.storage import (
    DEFAULT_DISK_MIN_FREE_MIB,
    DEFAULT_SHM_MIN_FREE_MIB,
    SHM,
    DirectoryCheck,
    shm_check,
)
from trainguard.health.stress import CpuCheck, MemoryCheck

__all__ = [
    "CHECK_NAMES",
    "HYPERPOD_ALIASES",
    "MONITOR_KINDS",
    "Peers",
    "SuiteConfig",
    "continuous_watch",
    "expand_check_names",
    "on_start_checks",
    "set_disk_full",
]

CHECK_NAMES: Final = ("cpu", "memory", "disk", "shm", "gpu", "connectivity")
HYPERPOD_ALIASES: Final[Mapping[str, tuple[str, ...]]] = {
    "InstanceStress": ("cpu", "memory", "disk", "shm", "gpu"),
    "InstanceConnectivity": ("connectivity",),
}


def expand_check_names(names: Iterable[str]) -> tuple[str, ...]:
    """Check names with HyperPod's aliases expanded, in `CHECK_NAMES` order, once each;
    ``ValueError`` names an unknown one."""
    wanted: set[str] = set()
    for name in names:
        if name in HYPERPOD_ALIASES:
            wanted.update(HYPERPOD_ALIASES[name])
        elif name in CHECK_NAMES:
            wanted.add(name)
        else:
            known = ", ".join([*CHECK_NAMES, *HYPERPOD_ALIASES])
            raise ValueError(f"unknown health check {name!r} (known: {known})")
    return tuple(name for name in CHECK_NAMES if name in wanted)


@dataclass(frozen=True)
class SuiteConfig:
    """Which on-start checks run, and their thresholds (0: report only)."""

    checks: tuple[str, ...] = CHECK_NAMES
    cpu_seconds: float = 0.5
    cpu_min_mb_per_s: float = 0.0
    memory_mib: int = 64
    memory_min_available_mib: float = 0.0
    disk_min_free_mib: float = DEFAULT_DISK_MIN_FREE_MIB
    shm_min_free_mib: float = DEFAULT_SHM_MIN_FREE_MIB
    expected_gpus: int | None = None
    dcgm_level: int = 1
    gpu_timeout: float = 120.0
    min_bandwidth_gbps: float = 0.0
    bandwidth_size_mib: float = 64
    connectivity_timeout: float = 120.0

    def __post_init__(self) -> None:
        expand_check_names(self.checks)


@dataclass(frozen=True)
class Peers:
    """This node's place in the connectivity test: its rank among the job's nodes, and
    where rank 0 hosts the rendezvous (the same address and port on every node)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def on_start_checks(
    config: SuiteConfig, job_dir: str | None = None, peers: Peers | None = None
) -> list[HealthCheck]:
    """The checks ``config`` names, in `CHECK_NAMES` order. ``job_dir``: where ``disk``
    writes (default: the temporary directory); ``peers``: None runs ``connectivity``
    alone (skipped)."""
    directory = job_dir if job_dir is not None else tempfile.gettempdir()
    peers = peers or Peers(0, 1, "127.0.0.1", 0)
    built: dict[str, HealthCheck] = {
        "cpu": CpuCheck(seconds=config.cpu_seconds, min_mb_per_s=config.cpu_min_mb_per_s),
        "memory": MemoryCheck(
            mib=config.memory_mib, min_available_mib=config.memory_min_available_mib
        ),
        "disk": DirectoryCheck(directory, min_free_mib=config.disk_min_free_mib),
        "shm": shm_check(min_free_mib=config.shm_min_free_mib),
        "gpu": GpuCheck(
            expected_gpus=config.expected_gpus,
            dcgm_level=config.dcgm_level,
            timeout=config.gpu_timeout,
        ),
        "connectivity": ConnectivityCheck(
            rank=peers.rank,
            world_size=peers.world_size,
            master_addr=peers.master_addr,
            master_port=peers.master_port,
            min_bandwidth_gbps=config.min_bandwidth_gbps,
            size_mib=config.bandwidth_size_mib,
            timeout=config.connectivity_timeout,
        ),
    }
    return [built[name] for name in expand_check_names(config.checks)]


MONITOR_KINDS: Final = ("kernel-log", "nvidia-smi", "space", "memory-pressure")
"""The monitors `continuous_watch` can build (``space``: the job dir and ``/dev/shm``)."""


def continuous_watch(
    job_dir: str,
    expected_gpus: int | None = None,
    disk_min_free_mib: float = DEFAULT_DISK_MIN_FREE_MIB,
    shm_min_free_mib: float = DEFAULT_SHM_MIN_FREE_MIB,
    env: Mapping[str, str] | None = None,
    *,
    only: Iterable[str] = MONITOR_KINDS,
    kmsg: bool = True,
) -> HealthWatch:
    """The monitors of `MONITOR_KINDS` named in ``only``: kernel log
    (``$TRAINGUARD_KERNEL_LOG``, and ``/dev/kmsg`` with ``kmsg``), nvidia-smi, free space
    on the job dir (``replace``: a new node brings a fresh disk) and ``/dev/shm``
    (``reboot``: a reboot empties it), memory pressure. ``ValueError`` names an unknown
    one."""
    chosen = set(only)
    unknown = sorted(chosen - set(MONITOR_KINDS))
    if unknown:
        raise ValueError(f"unknown monitor {unknown[0]!r} (known: {', '.join(MONITOR_KINDS)})")
    monitors: list[Monitor] = []
    if "kernel-log" in chosen:
        monitors.append(KernelLogMonitor(default_sources(env, kmsg)))
    if "nvidia-smi" in chosen:
        monitors.append(NvidiaSmiMonitor(expected_gpus=expected_gpus))
    if "space" in chosen:
        monitors.append(SpaceMonitor(job_dir, disk_min_free_mib, action="replace"))
        if os.path.isdir(SHM):
            monitors.append(SpaceMonitor(SHM, shm_min_free_mib, action="reboot"))
    if "memory-pressure" in chosen:
        monitors.append(MemoryPressureMonitor())
    return HealthWatch(monitors)


def set_disk_full(watch: HealthWatch, full: bool, directory: str | None = None) -> int:
    """Make the space monitors (those of ``directory``, or all) report full, or stop
    (``--inject disk-full``); how many were set."""
    count = 0
    for monitor in watch.monitors:
        if isinstance(monitor, SpaceMonitor) and directory in (None, monitor.directory):
            monitor.forced_full = full
            count += 1
    return count
