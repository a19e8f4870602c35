"""Job-wide hang timers: log rules and heartbeats, judged by the controller.

Pure: every time is given (unix seconds from the nodes' reports); nothing reads a
clock. One watch covers one attempt.

Timers do not run while the workers are stopped (HyperPod: "timers pause while
workers are stopped"): between `pause(t0)` and `resume(t1)` no time elapses, for
every reference time, including ones observed later (a match made before the pause
and reported after it is aged by its active time only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from trainguard.monitor.rules import LogRuleSpec
from trainguard.wire.status import RuleActivity

__all__ = ["HangDetection", "HangKind", "HangWatch", "HeartbeatWatch", "PauseClock", "StaleRank"]

HangKind = Literal["start", "recurring"]


class PauseClock:
    """Active time: wall time minus the time spent paused."""

    def __init__(self) -> None:
        self._pauses: list[tuple[float, float]] = []  # finished (start, end)
        self._paused_at: float | None = None

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def pause(self, now: float) -> None:
        """Stop the clock at ``now`` (no effect if already paused)."""
        if self._paused_at is None:
            self._paused_at = now

    def resume(self, now: float) -> None:
        """Restart the clock at ``now`` (no effect if not paused)."""
        if self._paused_at is not None:
            if now > self._paused_at:
                self._pauses.append((self._paused_at, now))
            self._paused_at = None

    def active(self, t: float) -> float:
        """``t`` minus all paused time before ``t``."""
        paused = sum(max(0.0, min(end, t) - start) for start, end in self._pauses)
        if self._paused_at is not None:
            paused += max(0.0, t - self._paused_at)
        return t - paused

    def elapsed(self, since: float, now: float) -> float:
        """Active seconds from ``since`` to ``now``."""
        return self.active(now) - self.active(since)


@dataclass(frozen=True)
class HangDetection:
    """A log rule that stopped matching: at `time`, nothing since `since` for > `limit` s."""

    rule: str
    kind: HangKind
    time: float
    since: float
    limit: float

    @property
    def reason(self) -> str:
        """HyperPod-style reason ``LogHang_<rule>``."""
        return f"LogHang_{self.rule}"


@dataclass
class _Timer:
    rule: LogRuleSpec
    last_match_at: float | None = None
    stopped: bool = False
    reported: bool = False


class HangWatch:
    """Hang timers of the log rules for one attempt, merged over every node's view.

    Start cut-off: no match on any node within `expectedStartCutOffInSeconds` of
    ``started_at``. Recurring: after the first match, more than
    `expectedRecurringFrequencyInSeconds` since the latest match on any node (before
    the first match only the cut-off applies). A rule seen stopped on any node never
    hangs. Each rule is reported at most once per watch.
    """

    def __init__(self, rules: Sequence[LogRuleSpec], started_at: float) -> None:
        self.started_at = started_at
        self._timers = {rule.name: _Timer(rule) for rule in rules}
        self._clock = PauseClock()

    def observe(self, rule_name: str, last_match_at: float | None, stopped: bool) -> None:
        """Merge one node's view of a rule (from its monitor's snapshot)."""
        timer = self._timers.get(rule_name)
        if timer is None:
            raise ValueError(f"hang watch: unknown log rule {rule_name!r}")
        if last_match_at is not None and (
            timer.last_match_at is None or last_match_at > timer.last_match_at
        ):
            timer.last_match_at = last_match_at
        timer.stopped = timer.stopped or stopped

    def observe_snapshot(self, rules: Mapping[str, RuleActivity]) -> None:
        """Merge the ``rules`` part of a node's `NodeLogMonitor.snapshot()`."""
        for name, view in rules.items():
            self.observe(name, view.last_match_at, view.stopped)

    def last_match_at(self, rule_name: str) -> float | None:
        """Latest match of the rule over all nodes observed so far."""
        return self._timers[rule_name].last_match_at

    def pause(self, now: float) -> None:
        self._clock.pause(now)

    def resume(self, now: float) -> None:
        self._clock.resume(now)

    def check(self, now: float) -> list[HangDetection]:
        """Rules that are hanging at ``now`` and were not reported before."""
        found: list[HangDetection] = []
        for timer in self._timers.values():
            if timer.reported or timer.stopped:
                continue
            hang = self._hang(timer, now)
            if hang is not None:
                timer.reported = True
                found.append(hang)
        return found

    def due(self) -> float | None:
        """The soonest a rule can hang, from what was observed so far (a pause only puts
        it off); None: none can."""
        times = []
        for timer in self._timers.values():
            running = None if timer.reported or timer.stopped else self._running(timer)
            if running is not None:
                _, since, limit = running
                times.append(since + limit)
        return min(times, default=None)

    def _hang(self, timer: _Timer, now: float) -> HangDetection | None:
        running = self._running(timer)
        if running is None:
            return None
        kind, since, limit = running
        if self._clock.elapsed(since, now) > limit:
            return HangDetection(timer.rule.name, kind, now, since, limit)
        return None

    def _running(self, timer: _Timer) -> tuple[HangKind, float, float] | None:
        """The rule's timer that runs: its kind, since when, and its limit. Before the
        first match only the start cut-off (None without one); then the recurring one."""
        rule = timer.rule
        if timer.last_match_at is None:
            cutoff = rule.expected_start_cut_off_in_seconds
            return None if cutoff is None else ("start", self.started_at, cutoff)
        every = rule.expected_recurring_frequency_in_seconds
        return None if every is None else ("recurring", timer.last_match_at, every)


class StaleRank(NamedTuple):
    """A rank whose heartbeat is older than the timeout."""

    rank: int
    last_beat_at: float


class HeartbeatWatch:
    """Heartbeat timeouts for one attempt: a rank that beat once, then stopped.

    Ranks that never beat are not judged (the script may not use heartbeats); each
    stale rank is reported once per watch.
    """

    def __init__(self, timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"heartbeat timeout: must be > 0, got {timeout!r}")
        self.timeout = timeout
        self._beats: dict[int, float] = {}
        self._reported: set[int] = set()
        self._clock = PauseClock()

    def observe(self, rank: int, last_beat_at: float) -> None:
        """The latest beat of ``rank`` seen by its node (older values are ignored)."""
        if last_beat_at > self._beats.get(rank, float("-inf")):
            self._beats[rank] = last_beat_at

    def pause(self, now: float) -> None:
        self._clock.pause(now)

    def resume(self, now: float) -> None:
        self._clock.resume(now)

    def due(self) -> float | None:
        """The soonest a rank can go stale, from the beats seen so far (None: none can)."""
        return min(
            (beat + self.timeout for r, beat in self._beats.items() if r not in self._reported),
            default=None,
        )

    def check(self, now: float) -> list[StaleRank]:
        """Ranks whose last beat is more than `timeout` active seconds old, not reported yet."""
        stale: list[StaleRank] = []
        for rank, beat in sorted(self._beats.items()):
            if rank in self._reported:
                continue
            if self._clock.elapsed(beat, now) > self.timeout:
                self._reported.add(rank)
                stale.append(StaleRank(rank, beat))
        return stale
