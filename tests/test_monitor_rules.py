"""Log rules in the agent: one test per rule field, wire format, snapshot."""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import pytest

from trainguard.monitor.progress import ProgressMatcher
from trainguard.monitor.regex import compile_regex, match_line
from trainguard.monitor.rules import (
    MAX_DETECTIONS,
    MAX_LINE_CHARS,
    Detection,
    LogRuleSpec,
    NodeLogMonitor,
    parse_metric,
)
from trainguard.spec import SpecError, parse_job
from trainguard.spec.model import LogRule

SPEED = r".*Speed: ([^ ]+) samples/sec.*"


def batch(step: int, speed: float | str = 100.0, loss: float | str = 1.5) -> str:
    return f"Batch {step} Loss: {loss}, Speed: {speed} samples/sec, lr: 0.001000"


def feed(monitor: NodeLogMonitor, rank: int, lines: list[str], t0: float = 1000.0) -> None:
    for i, line in enumerate(lines):
        monitor.on_line(rank, "stdout", line, t0 + i)


def kinds(monitor: NodeLogMonitor) -> list[tuple[str, str, int]]:
    return [(d["kind"], d["rule"], d["rank"]) for d in monitor.snapshot().to_json()["detections"]]


def _job(spec: dict[str, Any]) -> dict[str, Any]:
    """A minimal job whose spec also has ``spec``."""
    container = {"name": "c", "command": ["python", "t.py"]}
    group = {"name": "worker", "template": {"spec": {"containers": [container]}}}
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "tiny"},
        "spec": {"replicaSpecs": [group], **spec},
    }


def rule_view(monitor: NodeLogMonitor, name: str) -> dict[str, Any]:
    view: dict[str, Any] = monitor.snapshot().to_json()["rules"][name]
    return view


# --- logPattern ---------------------------------------------------------------------------


def test_log_pattern_is_anchored_at_line_start_and_read_on_every_rank_and_stream() -> None:
    monitor = NodeLogMonitor([LogRuleSpec("loss", "Loss:")])
    monitor.on_line(0, "stdout", "Batch 1 Loss: 2.0", 10.0)  # "Loss:" not at the start
    assert rule_view(monitor, "loss") == {"last_match_at": None, "matches": 0, "stopped": False}
    monitor.on_line(3, "stderr", "Loss: 2.0", 11.0)
    monitor.on_line(1, "stdout", "Loss: 1.9", 12.0)
    assert rule_view(monitor, "loss") == {"last_match_at": 12.0, "matches": 2, "stopped": False}


def test_last_match_time_never_goes_back() -> None:
    monitor = NodeLogMonitor([LogRuleSpec("loss", ".*Loss:.*")])
    monitor.on_line(0, "stdout", batch(2), 20.0)
    monitor.on_line(1, "stdout", batch(1), 15.0)  # another rank's older line read later
    assert rule_view(monitor, "loss")["last_match_at"] == 20.0


# --- metricThreshold + operator -----------------------------------------------------------


@pytest.mark.parametrize(
    ("operator", "bad", "good"),
    [
        ("gt", [81.0, 1000.0], [80.0, 79.0]),
        ("lt", [79.0, 0.0], [80.0, 81.0]),
        ("eq", [80.0], [79.9, 80.1]),
        ("gteq", [80.0, 81.0], [79.0]),
        ("lteq", [80.0, 79.0], [81.0]),
    ],
)
def test_threshold_operator_states_the_bad_condition(
    operator: str, bad: list[float], good: list[float]
) -> None:
    rule = LogRuleSpec.from_json(
        {"name": "speed", "logPattern": SPEED, "metricThreshold": 80, "operator": operator}
    )
    for value in good:
        monitor = NodeLogMonitor([rule])
        monitor.on_line(0, "stdout", batch(1, value), 1.0)
        assert kinds(monitor) == [], (operator, value)
    for value in bad:
        monitor = NodeLogMonitor([rule])
        monitor.on_line(0, "stdout", batch(1, value), 1.0)
        (detection,) = monitor.snapshot().to_json()["detections"]
        assert detection["kind"] == "LogSlow"
        assert detection["value"] == value
        assert Detection.from_json(detection).reason == "LogSlow_speed"


def test_metric_that_is_not_a_number_is_ignored() -> None:
    rule = LogRuleSpec("speed", SPEED, metric_threshold=80, operator="lteq")
    monitor = NodeLogMonitor([rule])
    monitor.on_line(0, "stdout", batch(1, "n/a"), 1.0)
    assert kinds(monitor) == []
    assert rule_view(monitor, "speed")["matches"] == 1


# --- metricEvaluationDataPoints -----------------------------------------------------------


def test_data_points_count_consecutive_bad_values_per_rank() -> None:
    rule = LogRuleSpec(
        "speed", SPEED, metric_threshold=80, operator="lteq", metric_evaluation_data_points=3
    )
    monitor = NodeLogMonitor([rule])
    # rank 0: bad, bad, good (resets), bad, bad -> never 3 in a row
    feed(monitor, 0, [batch(1, 10), batch(2, 10), batch(3, 90), batch(4, 10), batch(5, 10)])
    # rank 1 interleaved bad values do not add to rank 0's run
    feed(monitor, 1, [batch(1, 10), batch(2, 10)])
    assert kinds(monitor) == []
    monitor.on_line(0, "stdout", batch(6, 10), 2000.0)  # third in a row for rank 0
    assert kinds(monitor) == [("LogSlow", "speed", 0)]


def test_slow_is_reported_once_per_run_of_bad_values() -> None:
    rule = LogRuleSpec(
        "speed", SPEED, metric_threshold=80, operator="lteq", metric_evaluation_data_points=2
    )
    monitor = NodeLogMonitor([rule])
    feed(monitor, 0, [batch(i, 10) for i in range(10)])
    assert kinds(monitor) == [("LogSlow", "speed", 0)]
    feed(monitor, 0, [batch(10, 100), batch(11, 10), batch(12, 10)])  # new run after a good one
    assert kinds(monitor) == [("LogSlow", "speed", 0)] * 2


def test_default_data_points_is_one() -> None:
    assert LogRuleSpec("r", ".*").metric_evaluation_data_points == 1
    assert (
        LogRuleSpec.from_json({"name": "r", "logPattern": ".*"}).metric_evaluation_data_points == 1
    )


# --- NaN / inf ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity"])
def test_non_finite_metric_is_its_own_fault_whatever_the_operator(text: str) -> None:
    # "gt 1e9" would never call nan or -inf slow; the non-finite value is a fault anyway
    rule = LogRuleSpec("loss", r".*Loss: (\S+),.*", metric_threshold=1e9, operator="gt")
    monitor = NodeLogMonitor([rule])
    feed(monitor, 2, [batch(1, loss=text), batch(2, loss=text)])
    (detection,) = monitor.snapshot().to_json()["detections"]  # once per rank
    assert (detection["kind"], detection["rank"]) == ("NaNMetric", 2)
    assert isinstance(detection["value"], str)  # strict JSON: no bare NaN/Infinity
    json.dumps(monitor.snapshot().to_json(), allow_nan=False)
    parsed = Detection.from_json(detection)
    assert parsed.value is not None and not math.isfinite(parsed.value)
    assert parsed.reason == "NaNMetric_loss"


def test_non_finite_metric_is_a_fault_without_threshold_but_words_are_not() -> None:
    monitor = NodeLogMonitor([LogRuleSpec("loss", r".*Loss: (\S+)")])
    monitor.on_line(0, "stdout", "Loss: info", 1.0)  # "info" is not "inf"
    monitor.on_line(0, "stdout", "Loss: 1.25", 2.0)
    assert kinds(monitor) == []
    monitor.on_line(0, "stdout", "Loss: nan", 3.0)
    assert kinds(monitor) == [("NaNMetric", "loss", 0)]


# --- stopPattern --------------------------------------------------------------------------


def test_stop_pattern_switches_the_rule_off() -> None:
    rule = LogRuleSpec(
        "speed",
        SPEED,
        stop_pattern=".*Training complete.*",
        metric_threshold=80,
        operator="lteq",
        fault_on_match=False,
    )
    monitor = NodeLogMonitor([rule])
    monitor.on_line(0, "stdout", batch(1, 100), 1.0)
    monitor.on_line(1, "stdout", "Training complete: step 1, final loss 1.0", 2.0)
    monitor.on_line(0, "stdout", batch(2, 10), 3.0)  # would be slow
    assert rule_view(monitor, "speed") == {"last_match_at": 1.0, "matches": 1, "stopped": True}
    assert kinds(monitor) == []


# --- faultOnMatch -------------------------------------------------------------------------


def test_fault_on_match_makes_a_match_a_fault() -> None:
    rule = LogRuleSpec("oom", ".*CUDA out of memory.*", fault_on_match=True)
    other = LogRuleSpec("plain", ".*CUDA out of memory.*")
    monitor = NodeLogMonitor([rule, other])
    monitor.on_line(1, "stderr", "torch.OutOfMemoryError: CUDA out of memory. " + "x" * 900, 5.0)
    monitor.on_line(1, "stderr", "CUDA out of memory again", 6.0)
    (detection,) = monitor.detections()
    assert (detection.kind, detection.rule, detection.rank, detection.time) == (
        "LogFault",
        "oom",
        1,
        5.0,
    )
    assert detection.reason == "LogFault_oom"
    assert len(detection.line) == MAX_LINE_CHARS
    assert rule_view(monitor, "oom")["matches"] == 2


# --- timers are carried, not judged, here -------------------------------------------------


def test_timer_fields_round_trip_and_are_not_judged_per_line() -> None:
    data = {
        "name": "JobHangingDetection",
        "logPattern": ".*Loss:.*",
        "expectedStartCutOffInSeconds": 240,
        "expectedRecurringFrequencyInSeconds": 300,
    }
    rule = LogRuleSpec.from_json(data)
    assert rule.has_timer
    assert rule.to_json() == {**data, "metricEvaluationDataPoints": 1, "faultOnMatch": False}
    assert LogRuleSpec.from_json(json.loads(json.dumps(rule.to_json()))) == rule
    monitor = NodeLogMonitor([rule])
    feed(monitor, 0, ["nothing"] * 3)
    assert kinds(monitor) == []


# --- wire format and validation -----------------------------------------------------------


def test_from_model_matches_from_json() -> None:
    data = {
        "name": "speed",
        "logPattern": SPEED,
        "stopPattern": ".*done.*",
        "metricThreshold": 80.0,
        "operator": "lteq",
        "metricEvaluationDataPoints": 3,
        "faultOnMatch": False,
        "expectedStartCutOffInSeconds": 10.0,
        "expectedRecurringFrequencyInSeconds": 5.0,
    }
    assert LogRuleSpec.from_model(LogRule.model_validate(data)) == LogRuleSpec.from_json(data)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "r", "logPattern": "("}, "logPattern"),
        ({"name": "r", "logPattern": ".*", "stopPattern": "["}, "stopPattern"),
        ({"name": "r", "logPattern": "(.*)", "metricThreshold": 1}, "operator"),
        ({"name": "r", "logPattern": "(.*)", "operator": "gt"}, "metricThreshold"),
        ({"name": "r", "logPattern": "(.*)", "operator": "ge", "metricThreshold": 1}, "operator"),
        ({"name": "r", "logPattern": ".*", "operator": "gt", "metricThreshold": 1}, "logPattern"),
        ({"name": "r", "logPattern": ".*", "metricEvaluationDataPoints": 0}, "DataPoints"),
        ({"name": "r", "logPattern": ".*", "expectedStartCutOffInSeconds": 0}, "StartCutOff"),
        ({"name": "r", "logPattern": ".*", "expectedRecurringFrequencyInSeconds": -1}, "Frequency"),
        ({"name": "r", "logPattern": ".*", "faultOnMatch": "yes"}, "faultOnMatch"),
        ({"name": "r", "logPattern": ".*", "bogus": 1}, "bogus"),
        ({"name": "r"}, "logPattern"),
    ],
)
def test_bad_rule_names_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LogRuleSpec.from_json(data)


# --- RE2: no pattern can stall the log reader -----------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"(a)\1", "backreferences are not supported"),
        (r"(?P<x>a)(?P=x)", "backreferences are not supported"),
        (r"Loss(?=:)", "lookahead is not supported"),
        (r"(?<!x)Loss", "lookbehind is not supported"),
        (r"a*+b", "possessive quantifiers are not supported"),
        (r"(?>a+)b", "atomic groups are not supported"),
    ],
)
def test_patterns_re2_cannot_compile_are_refused_with_the_field_path(
    pattern: str, why: str
) -> None:
    with pytest.raises(ValueError, match=f"log rule 'r': logPattern: RE2 .*{why}"):
        LogRuleSpec.from_json({"name": "r", "logPattern": pattern})
    with pytest.raises(ValueError, match=f"stopPattern: RE2 .*{why}"):
        LogRuleSpec.from_json({"name": "r", "logPattern": ".*", "stopPattern": pattern})
    # In a spec: exit 2's one line names the field.
    for key, where in [
        ("logPattern", "spec.runPolicy.logMonitoringConfiguration[0].logPattern"),
        ("stopPattern", "spec.runPolicy.logMonitoringConfiguration[0].stopPattern"),
    ]:
        rule = {"name": "r", "logPattern": ".*", key: pattern}
        data = _job({"runPolicy": {"logMonitoringConfiguration": [rule]}})
        with pytest.raises(SpecError) as info:
            parse_job(data, "job.yaml")
        assert str(info.value).startswith(f"job.yaml: {where}: RE2 (linear-time matching)")
        assert why in str(info.value) and "\n" not in str(info.value)
    data = _job({"trainguard": {"progressPattern": pattern}})
    with pytest.raises(SpecError, match=r"job.yaml: spec.trainguard.progressPattern: RE2 "):
        parse_job(data, "job.yaml")


def test_a_catastrophic_pattern_is_accepted_and_bounded_in_time() -> None:
    """``(a+)+$`` backtracks exponentially in Python's re; RE2 runs it in linear time."""
    catastrophic = r"(a+)+$"
    parse_job(
        _job(
            {
                "runPolicy": {
                    "logMonitoringConfiguration": [
                        {"name": "r", "logPattern": catastrophic, "stopPattern": catastrophic}
                    ]
                },
                "trainguard": {"progressPattern": r"(a+)+(\d+)$"},
            }
        ),
        "job.yaml",
    )
    rule = LogRuleSpec("r", catastrophic, fault_on_match=True)
    monitor = NodeLogMonitor([rule], ProgressMatcher(r"(a+)+(\d+)$"))
    started = time.monotonic()
    for line in ["a" * 40 + "!", "a" * 100_000 + "!", "a" * 1_000_000 + "!"]:
        monitor.on_line(0, "stdout", line, 1.0)
    elapsed = time.monotonic() - started
    assert elapsed < 5.0  # Python's re: about 2**40 steps for the first line alone
    assert rule_view(monitor, "r")["matches"] == 0
    monitor.on_line(0, "stdout", "a" * 40, 2.0)
    assert kinds(monitor) == [("LogFault", "r", 0)]


def test_re2_keeps_re_match_semantics_and_group_one() -> None:
    rule = LogRuleSpec(
        "speed", r"(?i).*speed: (?P<v>[^ ]+) samples/sec", operator="lt", metric_threshold=50.0
    )
    monitor = NodeLogMonitor([rule])
    monitor.on_line(0, "stdout", "x " + batch(1, speed=10.0), 1.0)  # not anchored at the end
    monitor.on_line(1, "stdout", batch(1, speed=20.0).upper(), 2.0)  # (?i)
    monitor.on_line(2, "stdout", batch(1, speed=60.0), 3.0)
    assert kinds(monitor) == [("LogSlow", "speed", 0), ("LogSlow", "speed", 1)]
    assert [d.value for d in monitor.detections()] == [10.0, 20.0]
    anchored = NodeLogMonitor([LogRuleSpec("a", r"Loss: (\d+)", fault_on_match=True)])
    anchored.on_line(0, "stdout", "Batch 1 Loss: 2", 1.0)  # re.match: at the start only
    assert kinds(anchored) == []


def test_duplicate_rule_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        NodeLogMonitor([LogRuleSpec("a", ".*"), LogRuleSpec("a", "x")])


# --- snapshot -----------------------------------------------------------------------------


def test_snapshot_has_progress_per_rank_and_is_json() -> None:
    monitor = NodeLogMonitor([LogRuleSpec("loss", ".*Loss:.*")], ProgressMatcher())
    monitor.on_line(0, "stdout", batch(6), 60.0)
    monitor.on_line(0, "stdout", batch(7), 70.0)
    monitor.on_line(0, "stdout", "Completed checkpoint at step 7", 71.0)
    monitor.on_line(1, "stderr", "step: 6", 72.0)
    snap = json.loads(json.dumps(monitor.snapshot().to_json(), allow_nan=False))
    # Both ranks together: the earliest first step (rank 0's, at 60 s), the latest step.
    assert snap["progress"] == {"first_step": 6, "first_time": 60.0, "step": 7, "time": 70.0}
    assert snap["rules"]["loss"] == {"last_match_at": 70.0, "matches": 2, "stopped": False}
    assert snap["detections"] == []


def test_an_in_process_restarts_progress_starts_at_each_ranks_join() -> None:
    # Rank 0 printed step 15 just before the fault; its agent read the line after the
    # rejoin. It is the attempt before's: the new attempt's first step is the 11 it
    # redoes after the rollback (the fault's record: 5 steps lost, not 1).
    joined: set[int] = set()
    monitor = NodeLogMonitor([], ProgressMatcher(), joined=joined.__contains__)
    monitor.on_line(0, "stdout", batch(15), 100.0)
    assert monitor.snapshot().progress is None
    joined.add(0)
    monitor.on_line(0, "stdout", batch(11), 101.0)
    monitor.on_line(0, "stdout", batch(12), 101.5)
    joined.clear()  # asked until a rank has joined, not after
    monitor.on_line(0, "stdout", batch(13), 102.0)
    progress = monitor.snapshot().progress
    assert progress is not None
    assert (progress.first_step, progress.first_time, progress.step) == (11, 101.0, 13)


def test_detections_are_bounded() -> None:
    rule = LogRuleSpec("err", ".*Error.*", fault_on_match=True)
    monitor = NodeLogMonitor([rule])
    for rank in range(MAX_DETECTIONS + 20):
        monitor.on_line(rank, "stderr", "Error", float(rank))
    detections = monitor.snapshot().to_json()["detections"]
    assert len(detections) == MAX_DETECTIONS
    assert detections[0]["rank"] == 0  # the first ones are kept


def test_on_line_and_snapshot_from_two_threads() -> None:
    monitor = NodeLogMonitor([LogRuleSpec("loss", ".*Loss:.*")], ProgressMatcher())
    lines = 5000

    def tail() -> None:
        for i in range(lines):
            monitor.on_line(i % 4, "stdout", batch(i), float(i))

    thread = threading.Thread(target=tail)
    thread.start()
    while thread.is_alive():
        json.dumps(monitor.snapshot().to_json())
    thread.join()
    assert rule_view(monitor, "loss")["matches"] == lines


@pytest.mark.parametrize(
    ("pattern", "line"),
    [
        (r".*Loss: ([0-9.e+-]+|nan)", "Batch 3 Loss: 0.25, Speed: 1.0"),
        (r".*Loss: ([0-9.e+-]+|nan)", "Batch 3 Loss: nan"),
        (r".*Loss: ([0-9.e+-]+|nan)", "no loss here"),
        (r"(?i)step (\d+)(?:/(\d+))?", "STEP 7"),
        (r"(?P<name>\w+)=(\d+)", "lr=3 momentum"),
        (r".*é (\w+)", "café au lait"),  # not ASCII: matched as text
        (r".*\xff(\d)", "bad \xff7 byte"),
        (r"x*", ""),
    ],
)
def test_a_line_matched_as_bytes_gives_what_re2_gives_on_the_text(pattern: str, line: str) -> None:
    """match_line matches an ASCII line as its bytes (cheaper); what it finds is the same."""
    compiled = compile_regex(pattern)
    expected, found = compiled.match(line), match_line(compiled, line)
    assert (expected is None) == (found is None)
    if expected is not None and found is not None:
        for index in range(compiled.groups + 1):
            assert found.group(index) == expected.group(index)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12.5", 12.5),
        (".5", 0.5),
        ("5.", 5.0),
        ("1234", 1234.0),
        ("1.2.3", 1.2),
        ("1_000", 1.0),  # float() would take the underscore: the number is "1"
        ("\uff11\uff12", 12.0),  # full-width digits, as Python reads them
        (" 7 samples", 7.0),
        ("1e3", 1000.0),
        ("", None),
        (".", None),
        (None, None),
    ],
)
def test_a_metric_is_the_number_at_the_start_of_its_group(
    text: str | None, value: float | None
) -> None:
    assert parse_metric(text) == value
