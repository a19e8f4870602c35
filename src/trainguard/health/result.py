"""What health checks and monitors say: a `CheckResult` per on-start check, a `Finding`
per fault a continuous monitor sees.

Both are plain values that travel as JSON-able dicts (``to_json``): in the agent's status
(checked there as :mod:`trainguard.wire.health`), in the job's timeline, in
``trainguard health-check -o json``.

A finding's ``action`` is the remedy it asks for, named after HyperPod's node labels:
``replace`` (``UnschedulablePendingReplacement``: the hardware is suspect, use another
node) or ``reboot`` (``UnschedulablePendingReboot``: a reset clears it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, TypeAlias, get_args

__all__ = [
    "ACTIONS",
    "FINDING_KINDS",
    "NODE_HEALTH_STATUS",
    "OUTCOMES",
    "Action",
    "CheckResult",
    "Evidence",
    "Finding",
    "FindingKind",
    "JsonValue",
    "Outcome",
]

JsonValue: TypeAlias = str | int | float | bool | list["JsonValue"] | dict[str, "JsonValue"] | None
Evidence: TypeAlias = dict[str, JsonValue]
"""Measurements and facts behind a result (numbers, strings, small lists), JSON-able."""

Outcome = Literal["passed", "failed", "skipped"]
OUTCOMES: Final[tuple[Outcome, ...]] = get_args(Outcome)

Action = Literal["replace", "reboot"]
ACTIONS: Final[tuple[Action, ...]] = get_args(Action)

NODE_HEALTH_STATUS: Final[Mapping[Action, str]] = {
    "replace": "UnschedulablePendingReplacement",
    "reboot": "UnschedulablePendingReboot",
}
"""HyperPod's ``node-health-status`` value for a node with a finding of each action."""

FindingKind = Literal["XID", "NVRM", "GpuCount", "Ecc", "DiskSpace", "MemoryPressure"]
FINDING_KINDS: Final[tuple[FindingKind, ...]] = get_args(FindingKind)


@dataclass(frozen=True)
class CheckResult:
    """One on-start check's verdict. ``seconds`` is the wall time it took (set by the runner)."""

    name: str
    outcome: Outcome
    message: str
    evidence: Evidence = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class Finding:
    """A fault a continuous monitor saw on this node, with the remedy it asks for.

    ``time`` is the wall-clock time (Unix seconds) the monitor saw it.
    """

    kind: FindingKind
    action: Action
    message: str
    evidence: Evidence = field(default_factory=dict)
    time: float = 0.0

    @property
    def node_health_status(self) -> str:
        """HyperPod's label value this finding puts its node in."""
        return NODE_HEALTH_STATUS[self.action]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
