"""The agent's side of fault detection: match every rank's lines, read heartbeats.

The controller sends the log rules and the progress pattern with every attempt
(``NodeAssignment.monitor``); the agent applies them to each line its tailer reads and
reports what it saw in its status. Hang timers are not run here: whether a rule is
hanging is a job-wide question the controller answers.
"""

from __future__ import annotations

from collections.abc import Callable

from trainguard.monitor.progress import DEFAULT_PROGRESS_PATTERN, ProgressMatcher
from trainguard.monitor.rules import LogRuleSpec, NodeLogMonitor
from trainguard.wire.requests import MonitorConfig


def build_monitor(
    monitor: MonitorConfig,
    on_detection: Callable[[], None] | None = None,
    joined: Callable[[int], bool] | None = None,
) -> NodeLogMonitor:
    """The line monitor an assignment asks for; ``ValueError`` names what is wrong.

    ``on_detection`` is called after each fault seen in a line (to report it at once).
    """
    rules = []
    for i, raw in enumerate(monitor.log_rules):
        try:
            rules.append(LogRuleSpec.from_json(raw))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"log_rules[{i}]: {exc}") from None
    try:
        progress = ProgressMatcher(monitor.progress_pattern or DEFAULT_PROGRESS_PATTERN)
    except ValueError as exc:
        raise ValueError(f"progress_pattern: {exc}") from None
    return NodeLogMonitor(rules, progress, on_detection=on_detection, joined=joined)
