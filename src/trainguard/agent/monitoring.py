"""The agent's side of fault detection: match every rank's lines, read heartbeats.

The controller sends the log rules and the progress pattern with ``/start``
(``NodeAssignment.monitor``); the agent applies them to each line its tailer
reads and reports what it saw in ``GET /status``. Hang timers are not run
here: whether a rule is hanging is a job-wide question the controller answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainguard.monitor.progress import DEFAULT_PROGRESS_PATTERN, ProgressMatcher
from trainguard.monitor.rules import LogRuleSpec, NodeLogMonitor


def build_monitor(monitor: Mapping[str, Any]) -> NodeLogMonitor:
    """The line monitor an assignment asks for; ``ValueError`` names what is wrong."""
    unknown = sorted(set(monitor) - {"log_rules", "progress_pattern"})
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    raw_rules = monitor.get("log_rules") or []
    if not isinstance(raw_rules, list):
        raise ValueError("log_rules: expected a list")
    rules = []
    for i, raw in enumerate(raw_rules):
        if not isinstance(raw, dict):
            raise ValueError(f"log_rules[{i}]: expected an object")
        try:
            rules.append(LogRuleSpec.from_json(raw))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"log_rules[{i}]: {exc}") from None
    pattern = monitor.get("progress_pattern") or DEFAULT_PROGRESS_PATTERN
    if not isinstance(pattern, str):
        raise ValueError("progress_pattern: expected a string")
    try:
        progress = ProgressMatcher(pattern)
    except ValueError as exc:
        raise ValueError(f"progress_pattern: {exc}") from None
    return NodeLogMonitor(rules, progress)
