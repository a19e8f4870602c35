"""What a node agent is told of its job's health checks (its ``--health`` flag).

The spec's ``healthChecks`` (:class:`trainguard.spec.health.HealthOptions`, validated
with field paths) is turned into these plain values for the agent, which never imports
the spec models (a faster start): which on-start checks and monitors, and thresholds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from trainguard.health.suite import SuiteConfig, expand_check_names

__all__ = ["MONITOR_KIND", "MONITOR_NAMES", "HealthSettings"]

MONITOR_NAMES = ("kernelLog", "gpu", "disk", "memory")
# Each spec monitor name's kind in `trainguard.health.suite.continuous_watch`.
MONITOR_KIND = {
    "kernelLog": "kernel-log",
    "gpu": "nvidia-smi",
    "disk": "space",
    "memory": "memory-pressure",
}


@dataclass(frozen=True)
class HealthSettings:
    checks: tuple[str, ...] = ()  # on-start checks (no aliases)
    continuous: tuple[str, ...] = MONITOR_NAMES
    min_bandwidth_gbps: float = 0.0
    min_free_disk_mib: float = 512
    min_free_shm_mib: float = 32
    expected_gpus: int | None = None
    check_timeout_seconds: float = 120.0

    def __post_init__(self) -> None:
        if expand_check_names(self.checks) != self.checks:
            raise ValueError(f"checks: {list(self.checks)} are not plain check names in order")
        unknown = [m for m in self.continuous if m not in MONITOR_NAMES]
        if unknown:
            raise ValueError(f"continuous: unknown monitor {unknown[0]!r}")
        for name in ("min_bandwidth_gbps", "min_free_disk_mib", "min_free_shm_mib"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not (math.isfinite(self.check_timeout_seconds) and self.check_timeout_seconds > 0):
            raise ValueError("check_timeout_seconds: must be a finite number > 0")

    def suite(self) -> SuiteConfig:
        return SuiteConfig(
            checks=self.checks,
            disk_min_free_mib=self.min_free_disk_mib,
            shm_min_free_mib=self.min_free_shm_mib,
            expected_gpus=self.expected_gpus,
            gpu_timeout=self.check_timeout_seconds,
            min_bandwidth_gbps=self.min_bandwidth_gbps,
            connectivity_timeout=self.check_timeout_seconds,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> HealthSettings:
        """ValueError naming the problem."""
        try:
            data: Any = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, Mapping):
            raise ValueError("expected a JSON object")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field")
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in ("checks", "continuous"):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ValueError(f"{key}: must be a list of names")
                value = tuple(value)
            elif key == "expected_gpus":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                    raise ValueError(f"{key}: must be an integer or null")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key}: must be a number")
            values[key] = value
        return cls(**values)
