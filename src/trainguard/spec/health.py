"""``spec.trainguard.healthChecks``: deep checks before a node takes ranks, and the
monitors that watch it while it works (:mod:`trainguard.health`).

HyperPod's ``OnStartDeepHealthChecks`` names are accepted in ``onStart``:
``InstanceStress`` (cpu, memory, disk, shm, gpu) and ``InstanceConnectivity``
(connectivity).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from trainguard.health.settings import HealthSettings
from trainguard.health.suite import CHECK_NAMES, HYPERPOD_ALIASES, expand_check_names
from trainguard.spec.fields import Seconds, SpecModel

__all__ = ["MONITOR_NAMES", "HealthOptions"]

Monitor = Literal["kernelLog", "gpu", "disk", "memory"]
MONITOR_NAMES: tuple[Monitor, ...] = ("kernelLog", "gpu", "disk", "memory")  # as settings
MAX_FREE_MIB = 1 << 30
MAX_BANDWIDTH_GBPS = 1e5


class HealthOptions(SpecModel):
    """Which checks run on a node before it takes ranks, which monitors watch it, and
    their thresholds. A node that fails a check never takes ranks; a monitor's finding
    puts its node out of the job (replaced by a spare when one is left)."""

    on_start: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="trainguard extension: deep checks each new node runs before it takes "
        f"ranks: {', '.join(CHECK_NAMES)}, or HyperPod's "
        f"{' and '.join(HYPERPOD_ALIASES)}. Empty (default): none.",
    )
    continuous: list[Monitor] = Field(
        default_factory=lambda: list(MONITOR_NAMES),
        max_length=len(MONITOR_NAMES),
        description="trainguard extension: what each node agent watches while the node "
        "works: kernelLog (XID/NVRM lines), gpu (nvidia-smi: GPU count, ECC), disk (free "
        "space on the job dir and /dev/shm), memory (memory pressure). Default: all.",
    )
    min_bandwidth_gbps: float = Field(
        default=0.0,
        ge=0,
        le=MAX_BANDWIDTH_GBPS,
        allow_inf_nan=False,
        description="trainguard extension: the connectivity check fails a node whose "
        "all-reduce bus bandwidth (GB/s) is under this. 0: report only.",
    )
    min_free_disk_mib: float = Field(
        default=512,
        ge=0,
        le=MAX_FREE_MIB,
        allow_inf_nan=False,
        description="trainguard extension: free space the job dir must have (MiB), at "
        "start and while the job runs.",
    )
    min_free_shm_mib: float = Field(
        default=32,
        ge=0,
        le=MAX_FREE_MIB,
        allow_inf_nan=False,
        description="trainguard extension: free space /dev/shm must have (MiB).",
    )
    expected_gpus: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="trainguard extension: GPUs each node must have (the gpu check and "
        "the gpu monitor). Unset: not checked.",
    )
    check_timeout_seconds: Seconds = Field(
        default=120.0,
        description="trainguard extension: a check still running after this has failed.",
    )

    @field_validator("on_start")
    @classmethod
    def _known_checks(cls, names: list[str]) -> list[str]:
        expand_check_names(names)  # ValueError names an unknown check
        return names

    @field_validator("continuous")
    @classmethod
    def _once_each(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError("each monitor at most once")
        return names

    @property
    def checks(self) -> tuple[str, ...]:
        """The on-start checks, HyperPod's aliases expanded, in a fixed order."""
        return expand_check_names(self.on_start)

    def settings(self) -> HealthSettings:
        """What each node agent is told (its ``--health`` flag: no secret is in here)."""
        return HealthSettings(
            checks=self.checks,
            continuous=tuple(self.continuous),
            min_bandwidth_gbps=self.min_bandwidth_gbps,
            min_free_disk_mib=self.min_free_disk_mib,
            min_free_shm_mib=self.min_free_shm_mib,
            expected_gpus=self.expected_gpus,
            check_timeout_seconds=self.check_timeout_seconds,
        )
