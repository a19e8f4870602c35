"""What a node agent says of its node's health (``NodeStatus.health``).

- ``deep``: its on-start (deep) health checks, HyperPod's ``deep-health-check-status``:
  ``InProgress`` while they run (the node takes no ranks yet), then ``Passed`` or
  ``Failed``; None when the job asked for none;
- ``checks``: each on-start check's result, as ``trainguard.health.CheckResult``;
- ``findings``: what the continuous monitors saw (an XID in the kernel log, a missing
  GPU, a full disk, memory pressure), numbered by ``seq`` so the controller takes each
  one once, as ``trainguard.health.Finding`` plus that number. The agent keeps the
  newest :data:`MAX_FINDINGS`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trainguard.wire.base import Wire

__all__ = ["MAX_CHECKS", "MAX_FINDINGS", "CheckReport", "FindingReport", "HealthReport"]

MAX_CHECKS = 32
MAX_FINDINGS = 32
_TEXT = 4096

DeepStatus = Literal["InProgress", "Passed", "Failed"]


class CheckReport(Wire):
    name: str = Field(min_length=1, max_length=64)
    outcome: Literal["passed", "failed", "skipped"]
    message: str = Field(max_length=_TEXT)
    evidence: dict[str, Any] = Field(default_factory=dict, max_length=64)
    seconds: float = Field(default=0.0, ge=0, le=1e7, allow_inf_nan=False)


class FindingReport(Wire):
    seq: int = Field(ge=0)
    kind: str = Field(min_length=1, max_length=64)
    action: Literal["replace", "reboot"]
    message: str = Field(max_length=_TEXT)
    evidence: dict[str, Any] = Field(default_factory=dict, max_length=64)
    time: float = Field(default=0.0, allow_inf_nan=False)


class HealthReport(Wire):
    deep: DeepStatus | None = None
    checks: tuple[CheckReport, ...] = Field(default=(), max_length=MAX_CHECKS)
    findings: tuple[FindingReport, ...] = Field(default=(), max_length=MAX_FINDINGS)
