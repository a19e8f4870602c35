"""Log rules (HyperPod's `logMonitoringConfiguration`) and the per-node line checks.

Split of work: which rank logs is up to the training script (the example logs from
global rank 0 only), so a HANG is judged job-wide by the controller (`hang.py`) from
every node's last match time. What one line tells by itself is judged here, in the
agent, per rank: SLOW (the metric is bad for `metricEvaluationDataPoints`
consecutive matches of that rank), FAULT (`faultOnMatch`) and a NaN/infinite metric.

Line semantics, per rule and line (stdout and stderr of every rank):

1. a line matching `stopPattern` switches the rule off for the rest of the attempt
   (on this node; the controller switches it off job-wide), and counts as nothing else;
2. a line matching `logPattern` (like ``re.match``, anchored at the line start) is a match:
   it updates the rule's last match time and count;
3. `faultOnMatch`: the match is a fault (reported once per rule and rank);
4. if the pattern's first group parses as a number, a NaN or infinite value is a
   `NaNMetric` fault (once per rule and rank), whether or not a threshold is set;
5. with `metricThreshold`/`operator`, a finite value for which ``value <operator>
   threshold`` holds is bad (the operator states the bad condition); N consecutive bad
   values of one rank report SLOW once; a good value ends the run (a later run of N bad
   values reports again). A group that is not a number is ignored.

Patterns are compiled by RE2 (:mod:`trainguard.monitor.regex`): matching is linear in the
line's length, so no pattern can stall the log reader; one RE2 cannot compile (a
backreference, lookaround) is refused with RE2's reason.
"""

from __future__ import annotations

import math
import operator as op
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, get_args

from trainguard.monitor.lines import (
    BlockScans,
    LineMatch,
    LinePattern,
    line_at,
    line_pattern,
    scannable,
)
from trainguard.monitor.progress import ProgressMatcher
from trainguard.monitor.regex import Pattern, RegexError, compile_regex
from trainguard.wire.status import (
    Detection,
    DetectionKind,
    MonitorSnapshot,
    Progress,
    RuleActivity,
)

if TYPE_CHECKING:
    from trainguard.spec.model import LogRule

__all__ = [
    "MAX_DETECTIONS",
    "MAX_LINE_CHARS",
    "Detection",
    "DetectionKind",
    "LogRuleSpec",
    "NodeLogMonitor",
    "Operator",
]

Operator = Literal["gt", "lt", "eq", "gteq", "lteq"]

MAX_LINE_CHARS: Final = 500
"""Evidence lines are cut to this many characters."""
MAX_DETECTIONS: Final = 100
"""A node monitor keeps its first this-many detections."""

_COMPARE: Final[Mapping[str, Callable[[float, float], bool]]] = {
    "gt": op.gt,
    "lt": op.lt,
    "eq": op.eq,
    "gteq": op.ge,
    "lteq": op.le,
}
# Ours, not a user's: Python's re, and linear (no nested repetition), on a captured group.
_NUMBER = re.compile(
    r"\s*([-+]?(?:(?:nan|inf(?:inity)?)(?![\w.])|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))", re.I
)

# camelCase wire key -> snake_case attribute
_KEYS: Final = {
    "name": "name",
    "logPattern": "log_pattern",
    "expectedStartCutOffInSeconds": "expected_start_cut_off_in_seconds",
    "expectedRecurringFrequencyInSeconds": "expected_recurring_frequency_in_seconds",
    "stopPattern": "stop_pattern",
    "metricThreshold": "metric_threshold",
    "operator": "operator",
    "metricEvaluationDataPoints": "metric_evaluation_data_points",
    "faultOnMatch": "fault_on_match",
}


def _problem(rule: str, key: str, message: str) -> ValueError:
    return ValueError(f"log rule {rule!r}: {key}: {message}")


@dataclass(frozen=True)
class LogRuleSpec:
    """One log rule as the controller sends it to agents (camelCase keys on the wire)."""

    name: str
    log_pattern: str
    expected_start_cut_off_in_seconds: float | None = None
    expected_recurring_frequency_in_seconds: float | None = None
    stop_pattern: str | None = None
    metric_threshold: float | None = None
    operator: Operator | None = None
    metric_evaluation_data_points: int = 1
    fault_on_match: bool = False

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise ValueError(f"log rule {name!r}: name: must be a non-empty string")
        for key in ("log_pattern", "stop_pattern"):
            pattern = getattr(self, key)
            if pattern is None and key == "stop_pattern":
                continue
            if not isinstance(pattern, str):
                raise _problem(name, _camel(key), "must be a string")
            try:
                compile_regex(pattern)
            except RegexError as err:
                raise _problem(name, _camel(key), str(err)) from None
        for key in ("expected_start_cut_off_in_seconds", "expected_recurring_frequency_in_seconds"):
            seconds = getattr(self, key)
            if seconds is not None and (not _is_number(seconds) or not seconds > 0):
                raise _problem(name, _camel(key), "must be a number > 0")
        if self.metric_threshold is not None and not _is_number(self.metric_threshold):
            raise _problem(name, "metricThreshold", "must be a number")
        if self.operator is not None and self.operator not in _COMPARE:
            raise _problem(name, "operator", f"must be one of {', '.join(get_args(Operator))}")
        if (self.metric_threshold is None) != (self.operator is None):
            missing = "operator" if self.operator is None else "metricThreshold"
            raise _problem(name, missing, "metricThreshold and operator go together")
        if self.metric_threshold is not None and self.pattern.groups < 1:
            raise _problem(name, "logPattern", "needs a capture group for the metric")
        points = self.metric_evaluation_data_points
        if isinstance(points, bool) or not isinstance(points, int) or points < 1:
            raise _problem(name, "metricEvaluationDataPoints", "must be an integer >= 1")
        if not isinstance(self.fault_on_match, bool):
            raise _problem(name, "faultOnMatch", "must be true or false")

    @property
    def pattern(self) -> Pattern:
        """The compiled `logPattern` (RE2; cached)."""
        return compile_regex(self.log_pattern)

    @property
    def stop(self) -> Pattern | None:
        """The compiled `stopPattern`, if any (RE2; cached)."""
        return None if self.stop_pattern is None else compile_regex(self.stop_pattern)

    @property
    def lines(self) -> LinePattern:
        """`logPattern` to run on a block of lines (cached)."""
        return line_pattern(self.log_pattern)

    @property
    def stop_lines(self) -> LinePattern | None:
        """`stopPattern`, if any, to run on a block of lines (cached)."""
        return None if self.stop_pattern is None else line_pattern(self.stop_pattern)

    @property
    def has_timer(self) -> bool:
        """Whether the rule can HANG (has a start cut-off or a recurring frequency)."""
        return (
            self.expected_start_cut_off_in_seconds is not None
            or self.expected_recurring_frequency_in_seconds is not None
        )

    def is_bad(self, value: float) -> bool:
        """``value <operator> metricThreshold`` (False without a threshold)."""
        if self.operator is None or self.metric_threshold is None:
            return False
        return _COMPARE[self.operator](value, self.metric_threshold)

    def to_json(self) -> dict[str, Any]:
        """camelCase keys; unset optional fields are left out."""
        out: dict[str, Any] = {}
        for key, attr in _KEYS.items():
            value = getattr(self, attr)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LogRuleSpec:
        """Parse camelCase keys; unknown keys and bad values are errors naming the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"log rule: must be an object, got {type(data).__name__}")
        name = data.get("name")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise _problem(str(name), unknown[0], "unknown field")
        for key in ("name", "logPattern"):
            if key not in data:
                raise _problem(str(name), key, "required")
        kwargs = {attr: data[key] for key, attr in _KEYS.items() if data.get(key) is not None}
        return cls(**kwargs)

    @classmethod
    def from_model(cls, rule: LogRule) -> LogRuleSpec:
        """From the validated spec model (`trainguard.spec.LogRule`)."""
        return cls(**{attr: getattr(rule, attr) for attr in _KEYS.values()})


def _camel(attr: str) -> str:
    return next(key for key, value in _KEYS.items() if value == attr)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_metric(text: str | None) -> float | None:
    """The number at the start of a captured group (``nan``/``inf`` included), or None."""
    if text is None:
        return None
    if text.isascii() and text.replace(".", "", 1).isdigit():  # the usual case: 12.5
        return float(text)
    found = _NUMBER.match(text)
    return None if found is None else float(found.group(1))


_Found = tuple[int, int, DetectionKind, "LogRuleSpec", float | None]
"""What a rule found in a block: (line offset, rule index, kind, rule, value)."""


@dataclass
class _RuleState:
    last_match_at: float | None = None
    matches: int = 0
    stopped: bool = False
    bad_run: dict[int, int] = field(default_factory=dict)  # rank -> consecutive bad values
    slow_reported: set[int] = field(default_factory=set)  # ranks in a reported bad run
    faulted: set[int] = field(default_factory=set)  # ranks reported for faultOnMatch
    nan_reported: set[int] = field(default_factory=set)  # ranks reported for NaN/inf


class NodeLogMonitor:
    """Applies the log rules to every line of this node's ranks, for one attempt.

    `on_line` is called by the log tailer thread; `snapshot` by whoever reports status.
    """

    def __init__(
        self,
        rules: Sequence[LogRuleSpec],
        progress: ProgressMatcher | None = None,
        on_detection: Callable[[], None] | None = None,
        joined: Callable[[int], bool] | None = None,
    ) -> None:
        """``on_detection``: called (with no lock held) after a line was found a fault;
        ``joined``: whether a rank has joined this attempt (an in-process restart's:
        the lines its process printed in the attempt before, read late, are no progress
        of this one; None: every line counts)."""
        names = [rule.name for rule in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"log rules: duplicate rule names in {names}")
        self._rules = list(rules)
        self._progress = progress
        self._state = {rule.name: _RuleState() for rule in rules}
        self._steps: dict[int, tuple[int, float]] = {}
        self._first_steps: dict[int, tuple[int, float]] = {}
        self._detections: list[Detection] = []
        self._on_detection = on_detection
        self._joined = joined
        self._members: set[int] = set()  # the ranks seen to have joined (joined() said so)
        self._lock = threading.Lock()

    def on_line(self, rank: int, stream: str, line: str, t: float) -> None:
        """One output line of ``rank`` (without its newline), read at unix time ``t``."""
        self.on_lines(rank, stream, line.encode(errors="replace") + b"\n", t)

    def on_lines(self, rank: int, stream: str, block: bytes, t: float) -> None:
        """Whole output lines of ``rank`` (each ending in a newline), read at unix time
        ``t``: judged as if one by one, in order (see the module docstring), with one RE2
        search per pattern and match (:mod:`trainguard.monitor.lines`)."""
        del stream  # both streams are read alike
        if not block:
            return
        text = scannable(block)
        step = self._progress.newest(text) if self._progress is not None else None
        if step is not None and not self._member(rank):
            step = None  # a step of the attempt before: not this one's progress
        with self._lock:
            if step is not None:
                self._steps[rank] = (step, t)
                if rank not in self._first_steps and self._progress is not None:
                    first = self._progress.oldest(text)
                    self._first_steps[rank] = (step if first is None else first, t)
            found: list[_Found] = []
            scans = BlockScans(text)
            for index, rule in enumerate(self._rules):
                state = self._state[rule.name]
                if not state.stopped:
                    found += self._apply(index, rule, state, rank, scans, t)
            for where, _, kind, rule, value in sorted(found, key=lambda f: f[:2]):
                self._detect(kind, rule, rank, t, line_at(text, where), value)
        if found and self._on_detection is not None:
            self._on_detection()

    def _member(self, rank: int) -> bool:
        """Whether ``rank``'s lines are this attempt's (asked until it is: then kept)."""
        if self._joined is None or rank in self._members:
            return True
        if self._joined(rank):
            self._members.add(rank)
            return True
        return False

    def _apply(
        self,
        index: int,
        rule: LogRuleSpec,
        state: _RuleState,
        rank: int,
        scans: BlockScans,
        t: float,
    ) -> list[_Found]:
        """Rule ``index`` on a block's lines: its state updated, what it found (a
        detection's line offset, the rule's index, kind, rule and value)."""
        stopped = None if rule.stop_lines is None else scans.first(rule.stop_lines)
        end = None if stopped is None else stopped.start  # the stop line counts as nothing
        matches = scans.lines(rule.lines, end)
        found: list[_Found] = []
        if rule.fault_on_match and matches and rank not in state.faulted:
            state.faulted.add(rank)
            found.append((matches[0].start, index, "LogFault", rule, None))
        if rule.lines.groups:  # a metric per line: judged line by line
            found += self._metrics(index, rule, state, rank, matches)
        if matches:
            state.matches += len(matches)
            if state.last_match_at is None or t > state.last_match_at:
                state.last_match_at = t
        if stopped is not None:
            state.stopped = True
        return found

    @staticmethod
    def _metrics(
        index: int, rule: LogRuleSpec, state: _RuleState, rank: int, matches: list[LineMatch]
    ) -> list[_Found]:
        """The metric of each of ``matches`` (a rule with a group): a NaN, or
        ``metricEvaluationDataPoints`` bad ones in a row, found (once per rank)."""
        found: list[_Found] = []
        watched = rule.metric_threshold is not None
        for match in matches:
            value = parse_metric(match.group)
            if value is None:
                continue
            if not math.isfinite(value):
                if rank not in state.nan_reported:
                    state.nan_reported.add(rank)
                    found.append((match.start, index, "NaNMetric", rule, value))
                continue
            if not watched:
                continue
            if not rule.is_bad(value):
                state.bad_run[rank] = 0
                state.slow_reported.discard(rank)
                continue
            run = state.bad_run.get(rank, 0) + 1
            state.bad_run[rank] = run
            if run >= rule.metric_evaluation_data_points and rank not in state.slow_reported:
                state.slow_reported.add(rank)
                found.append((match.start, index, "LogSlow", rule, value))
        return found

    def _detect(
        self,
        kind: DetectionKind,
        rule: LogRuleSpec,
        rank: int,
        t: float,
        line: str,
        value: float | None,
    ) -> None:
        if len(self._detections) < MAX_DETECTIONS:
            self._detections.append(
                Detection(
                    kind=kind,
                    rule=rule.name,
                    rank=rank,
                    time=t,
                    line=line[:MAX_LINE_CHARS],
                    value=value,
                )
            )

    def detections(self) -> list[Detection]:
        """Detections so far, oldest first (the first `MAX_DETECTIONS`)."""
        with self._lock:
            return list(self._detections)

    def _progress_now(self) -> Progress | None:
        """The ranks' progress together (lock held): the earliest first step, the latest."""
        if not self._steps:
            return None
        first_step, first_time = min(self._first_steps.values(), key=lambda v: (v[1], v[0]))
        step, t = max(self._steps.values())
        return Progress(first_step=first_step, first_time=first_time, step=step, time=t)

    def snapshot(self) -> MonitorSnapshot:
        """Per rule last match/count/stopped, the node's progress, detections, and each
        rank's latest step."""
        with self._lock:
            return MonitorSnapshot(
                rules={
                    name: RuleActivity(
                        last_match_at=state.last_match_at,
                        matches=state.matches,
                        stopped=state.stopped,
                    )
                    for name, state in self._state.items()
                },
                progress=self._progress_now(),
                detections=tuple(self._detections),
                rank_steps=dict(self._steps),
            )
