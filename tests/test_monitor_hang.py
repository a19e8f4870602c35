"""Job-wide hang timers (start cut-off, recurring frequency) and heartbeat timeouts."""

from __future__ import annotations

import pytest

from trainguard.monitor.hang import HangDetection, HangWatch, HeartbeatWatch, StaleRank
from trainguard.monitor.rules import LogRuleSpec, NodeLogMonitor

T0 = 1000.0
START = LogRuleSpec("JobStart", ".*Loss:.*", expected_start_cut_off_in_seconds=240)
RECUR = LogRuleSpec("JobHangingDetection", ".*Loss:.*", expected_recurring_frequency_in_seconds=300)
BOTH = LogRuleSpec(
    "Checkpointing",
    ".*Completed checkpoint.*",
    expected_start_cut_off_in_seconds=900,
    expected_recurring_frequency_in_seconds=600,
)


def test_start_cut_off_hangs_when_nothing_matched_in_time() -> None:
    watch = HangWatch([START], started_at=T0)
    assert watch.check(T0 + 240) == []
    (hang,) = watch.check(T0 + 240.5)
    assert hang == HangDetection("JobStart", "start", T0 + 240.5, T0, 240)
    assert hang.reason == "LogHang_JobStart"


def test_start_cut_off_is_met_by_one_match() -> None:
    watch = HangWatch([START], started_at=T0)
    watch.observe("JobStart", T0 + 239, stopped=False)
    assert watch.check(T0 + 10_000) == []  # no recurring frequency: nothing more to wait for


def test_recurring_frequency_applies_only_after_the_first_match() -> None:
    watch = HangWatch([RECUR], started_at=T0)
    assert watch.check(T0 + 10_000) == []  # never matched, no cut-off: not judged
    watch.observe("JobHangingDetection", T0 + 10_000, stopped=False)
    assert watch.check(T0 + 10_300) == []
    (hang,) = watch.check(T0 + 10_301)
    assert (hang.kind, hang.since, hang.limit) == ("recurring", T0 + 10_000, 300)


def test_rule_with_both_timers() -> None:
    watch = HangWatch([BOTH], started_at=T0)
    watch.observe("Checkpointing", T0 + 800, stopped=False)  # within the cut-off
    assert watch.check(T0 + 1000) == []  # the cut-off no longer applies
    assert watch.check(T0 + 1400) == []
    (hang,) = watch.check(T0 + 1401)
    assert hang.kind == "recurring"


def test_hang_is_reported_once_per_watch() -> None:
    watch = HangWatch([START], started_at=T0)
    assert len(watch.check(T0 + 300)) == 1
    assert watch.check(T0 + 400) == []


def test_any_node_match_resets_the_timer_job_wide() -> None:
    watch = HangWatch([RECUR], started_at=T0)
    # node A logs (rank 0), node B never does: B's empty view does not make the job hang
    watch.observe("JobHangingDetection", T0 + 100, stopped=False)
    watch.observe("JobHangingDetection", None, stopped=False)
    watch.observe("JobHangingDetection", T0 + 50, stopped=False)  # older view: max kept
    assert watch.last_match_at("JobHangingDetection") == T0 + 100
    assert watch.check(T0 + 400) == []
    assert [h.rule for h in watch.check(T0 + 401)] == ["JobHangingDetection"]


def test_snapshots_of_node_monitors_merge() -> None:
    node_a, node_b = NodeLogMonitor([RECUR, START]), NodeLogMonitor([RECUR, START])
    node_b.on_line(3, "stdout", "Batch 1 Loss: 1.0", T0 + 200)
    watch = HangWatch([RECUR, START], started_at=T0)
    for node in (node_a, node_b):
        watch.observe_snapshot(node.snapshot().rules)
    assert watch.check(T0 + 500) == []
    assert [h.rule for h in watch.check(T0 + 501)] == ["JobHangingDetection"]


def test_stop_pattern_seen_on_any_node_disables_the_rule() -> None:
    watch = HangWatch([START, RECUR], started_at=T0)
    watch.observe("JobStart", None, stopped=False)
    watch.observe("JobStart", None, stopped=True)
    watch.observe("JobHangingDetection", T0 + 1, stopped=True)
    watch.observe("JobHangingDetection", T0 + 2, stopped=False)  # stays stopped
    assert watch.check(T0 + 100_000) == []


def test_timers_do_not_run_while_paused() -> None:
    watch = HangWatch([START, RECUR], started_at=T0)
    watch.pause(T0 + 200)
    assert watch.check(T0 + 5000) == []  # frozen at 200 s of 240
    watch.resume(T0 + 5000)
    assert watch.check(T0 + 5040) == []  # 240 s active
    assert [h.rule for h in watch.check(T0 + 5041)] == ["JobStart"]
    watch.observe("JobHangingDetection", T0 + 5100, stopped=False)
    watch.pause(T0 + 5300)
    watch.resume(T0 + 9000)
    assert watch.check(T0 + 9100) == []  # 300 s active since the match
    assert [h.rule for h in watch.check(T0 + 9101)] == ["JobHangingDetection"]


def test_match_reported_after_a_pause_is_aged_by_active_time() -> None:
    watch = HangWatch([RECUR], started_at=T0)
    watch.pause(T0 + 100)
    watch.resume(T0 + 1000)
    watch.observe("JobHangingDetection", T0 + 50, stopped=False)  # made before the pause
    assert watch.check(T0 + 1250) == []  # 50 + 250 = 300 s active
    assert len(watch.check(T0 + 1251)) == 1


def test_unknown_rule_is_an_error() -> None:
    with pytest.raises(ValueError, match="nope"):
        HangWatch([START], T0).observe("nope", None, stopped=False)


def test_heartbeat_timeout_only_for_ranks_that_beat() -> None:
    watch = HeartbeatWatch(timeout=30)
    watch.observe(0, T0)
    watch.observe(1, T0 + 20)
    watch.observe(1, T0 + 10)  # older: ignored
    assert watch.check(T0 + 30) == []
    assert watch.check(T0 + 31) == [StaleRank(0, T0)]
    assert watch.check(T0 + 51) == [(1, T0 + 20)]
    assert watch.check(T0 + 1000) == []  # each reported once


def test_heartbeat_timers_pause() -> None:
    watch = HeartbeatWatch(timeout=30)
    watch.observe(2, T0)
    watch.pause(T0 + 10)
    assert watch.check(T0 + 100) == []
    watch.resume(T0 + 100)
    assert watch.check(T0 + 120) == []
    assert watch.check(T0 + 121) == [(2, T0)]


def test_heartbeat_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout"):
        HeartbeatWatch(0)
