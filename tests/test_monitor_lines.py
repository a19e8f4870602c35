"""Patterns run on a block of lines at once judge it exactly as its lines one by one."""

from __future__ import annotations

import itertools

import pytest

from trainguard.monitor.lines import LinePattern, scannable, split_lines
from trainguard.monitor.progress import ProgressMatcher
from trainguard.monitor.regex import compile_regex, match_line
from trainguard.monitor.rules import LogRuleSpec, NodeLogMonitor

# Empty lines, a line that is all spaces, non-ASCII text, bytes that are not UTF-8, a
# line a pattern could run into from the line before ("a" then "b").
BLOCK = (
    b"Batch 1 Loss: 0.5, Speed: 12.5 samples/sec\n"
    b"\n"
    b"a 12\n"
    b"b\n"
    b"   \n"
    b"caf\xc3\xa9 au lait 3\n"
    b"bad \xff\xfe 7\n"
    b"STEP 4 done\n"
    b"foo]\n"
    b"\n"
)
PATTERNS = [
    r".*Loss:.*",
    r".*Speed: ([0-9.]+) samples/sec.*",
    r"",
    r"x*",
    r"a[^x]*b",  # [^x] takes a newline: it must not reach the next line
    r"a\s*(\d+)",
    r"(?s)a.*b",
    r"[\s\S]*",
    r"(\w+)$",
    r"^$",
    r"\b",
    r"\B",
    r"(?i)step (\d+)",
    r".*é (\w+)",
    r".*(\d)$",
    r"[^\]]*\]",
    r"(?U).*?(\d+)",
    r".*\z",  # \z, \A, (?-m): matched a line at a time
    r"\Ab",
    r"(?-m)b$",
]


def one_by_one(pattern: str, block: bytes) -> list[tuple[int, str | None]]:
    """What matching each line alone finds: (offset of the line, group 1)."""
    regex = compile_regex(pattern)
    found, offset = [], 0
    for line in split_lines(scannable(block)):
        match = match_line(regex, line.decode(errors="replace"))
        if match is not None:
            found.append((offset, match.group(1) if regex.groups else None))
        offset += len(line) + 1
    return found


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_block_is_matched_as_its_lines_one_by_one(pattern: str) -> None:
    lines = LinePattern(pattern)
    text = scannable(BLOCK)
    expected = one_by_one(pattern, BLOCK)
    assert [tuple(m) for m in lines.matches(text)] == expected
    assert [tuple(m) for m in lines.scan(text)] == expected
    cut = expected[len(expected) // 2][0] if expected else len(text)  # a line's start
    assert [tuple(m) for m in lines.scan(text, cut)] == [m for m in expected if m[0] < cut]
    last = lines.last_line(text)
    last_start = text.rfind(b"\n", 0, len(text) - 1) + 1
    assert (None if last is None else tuple(last)) == next(
        (m for m in expected if m[0] == last_start), None
    )
    # Without google-re2's own call (another version of it): its public API, the same.
    if lines._block is not None:
        lines._block._raw = None
        assert [tuple(m) for m in lines.matches(text)] == expected
        assert [tuple(m) for m in lines.scan(text)] == expected


def test_rules_judge_a_block_as_its_lines_one_by_one_wherever_it_is_cut() -> None:
    """Consecutive bad values, a NaN, a fault, a stop line and progress come out the same
    whether the lines come one by one or in blocks cut anywhere (a run of bad values
    across two blocks counts as one run)."""
    rules = [
        LogRuleSpec(
            "speed",
            r".*Speed: ([^ ]+) samples/sec.*",
            metric_threshold=80,
            operator="lteq",
            metric_evaluation_data_points=3,
            stop_pattern=".*Training complete.*",
        ),
        LogRuleSpec("loss", r".*Loss: ([^,]+),.*"),
        LogRuleSpec("again", r".*Loss:.*"),  # the same lines as "loss": one scan for both
        LogRuleSpec("oom", ".*out of memory.*", fault_on_match=True),
    ]
    speeds = [100, 10, 10, 100, 10, 10, 10, 10, 100, 10]
    lines = [
        f"Batch {i} Loss: {'nan' if i == 4 else 0.5}, Speed: {s} samples/sec"
        for i, s in enumerate(speeds)
    ]
    lines[6:6] = ["CUDA out of memory", "Saved a checkpoint at step 6"]
    lines += ["Training complete", "Batch 20 Loss: 0.1, Speed: 1 samples/sec"]
    block = b"".join(line.encode() + b"\n" for line in lines)

    def judged(cuts: tuple[int, ...]) -> object:
        monitor = NodeLogMonitor(rules, ProgressMatcher())
        starts = [0, *itertools.accumulate(len(line) + 1 for line in split_lines(block))]
        offsets = [0, *(starts[cut] for cut in cuts), len(block)]
        for start, end in itertools.pairwise(offsets):
            monitor.on_lines(0, "stdout", block[start:end], 5.0)
        return monitor.snapshot().to_json()

    one_line_each = NodeLogMonitor(rules, ProgressMatcher())
    for line in lines:
        one_line_each.on_line(0, "stdout", line, 5.0)
    expected = one_line_each.snapshot().to_json()
    assert [(d["kind"], d["rule"]) for d in expected["detections"]] == [
        ("NaNMetric", "loss"),
        ("LogFault", "oom"),
        ("LogSlow", "speed"),
    ]
    assert expected["rules"]["speed"]["stopped"] and expected["progress"]["step"] == 20
    for cuts in itertools.combinations(range(1, len(lines)), 2):
        assert judged(cuts) == expected, cuts
    assert judged(()) == expected  # all at once


def test_progress_of_a_block_is_its_newest_step_and_its_first() -> None:
    progress = ProgressMatcher(r"(?:step|Step) (\d+|x)")
    block = b"Step 3\nstep x\nStep 4\nloss 1.0\nstep x\n"
    assert (progress.oldest(block), progress.newest(block)) == (3, 4)
    assert progress.newest(b"nothing\nhere\n") is None
