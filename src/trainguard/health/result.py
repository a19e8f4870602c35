"""What health checks and monitors say: a `CheckResult` per on-start check, a `Finding`
per fault a continuous monitor sees.

Both are plain values that travel as JSON-able dicts (``to_json`` / ``from_json``): in
the agent's status, in the job's timeline, in ``trainguard health-check -o json``.
``from_json`` refuses unknown keys and bad values with a ``ValueError`` naming the field.

A finding's ``action`` is the remedy it asks for, named after HyperPod's node labels:
``replace`` (``UnschedulablePendingReplacement``: the hardware is suspect, use another
node) or ``reboot`` (``UnschedulablePendingReboot``: a reset clears it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias, TypeVar, get_args

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
        return {
            "name": self.name,
            "outcome": self.outcome,
            "message": self.message,
            "evidence": dict(self.evidence),
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckResult:
        _keys(data, "check result", required=("name", "outcome", "message"))
        outcome = _choice(data["outcome"], OUTCOMES, "outcome")
        return cls(
            name=_text(data["name"], "name"),
            outcome=outcome,
            message=_text(data["message"], "message"),
            evidence=_evidence(data.get("evidence", {})),
            seconds=_number(data.get("seconds", 0.0), "seconds"),
        )


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
        return {
            "kind": self.kind,
            "action": self.action,
            "message": self.message,
            "evidence": dict(self.evidence),
            "time": self.time,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Finding:
        _keys(data, "finding", required=("kind", "action", "message"))
        return cls(
            kind=_choice(data["kind"], FINDING_KINDS, "kind"),
            action=_choice(data["action"], ACTIONS, "action"),
            message=_text(data["message"], "message"),
            evidence=_evidence(data.get("evidence", {})),
            time=_number(data.get("time", 0.0), "time"),
        )


_S = TypeVar("_S", bound=str)

_FIELDS: Final = {
    "check result": frozenset({"name", "outcome", "message", "evidence", "seconds"}),
    "finding": frozenset({"kind", "action", "message", "evidence", "time"}),
}


def _keys(data: Mapping[str, Any], what: str, required: tuple[str, ...]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - _FIELDS[what])
    if unknown:
        raise ValueError(f"{what}.{unknown[0]}: unknown field")
    for key in required:
        if key not in data:
            raise ValueError(f"{what}.{key}: required")


def _choice(value: object, choices: tuple[_S, ...], name: str) -> _S:
    for choice in choices:
        if value == choice:
            return choice
    raise ValueError(f"{name}: must be one of {', '.join(choices)}, got {value!r}")


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a string, got {type(value).__name__}")
    return value


def _number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    return float(value)


def _evidence(value: object) -> Evidence:
    if not isinstance(value, Mapping):
        raise ValueError(f"evidence: must be an object, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"evidence: keys must be strings, got {key!r}")
        _json_value(item, f"evidence.{key}")
    return dict(value)


def _json_value(value: object, name: str) -> None:
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{name}: must be finite, got {value!r}")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _json_value(item, f"{name}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{name}: keys must be strings, got {key!r}")
            _json_value(item, f"{name}.{key}")
        return
    raise ValueError(f"{name}: not a JSON value: {type(value).__name__}")
