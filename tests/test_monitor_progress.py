"""The training step read from worker output."""

from __future__ import annotations

import pytest

from trainguard.monitor.progress import ProgressMatcher


@pytest.mark.parametrize(
    ("line", "step"),
    [
        ("Batch 41 Loss: 2.31250, Speed: 812.50 samples/sec, lr: 0.000100", 41),
        ("Step 41/1000 loss=2.3", 41),
        ("step: 41", 41),
        ("step=41", 41),
        ("Iteration 41 done", 41),
        ("iter 41", 41),
        ("  Step 7", 7),
        ("[rank0]: Step 41", 41),
        ("[2024-05-01 12:00:00] step 41", 41),
        ("2024-05-01 12:00:00,123 INFO Step 41", 41),
        ("INFO:__main__:step 41", 41),
        ("| step 8 | loss 1.0", 8),
    ],
)
def test_completed_step_lines(line: str, step: int) -> None:
    assert ProgressMatcher().match(line) == step


@pytest.mark.parametrize(
    "line",
    [
        "Resumed from checkpoint at step 40",
        "Completed checkpoint at step 40",
        "Training complete: step 400, final loss 1.2",
        "Starting step 41",
        "Epoch 1 Step 41",
        "steps: 400",
        "Batch size: 32",
        "Stepper 4",
        "Step",
        "",
    ],
)
def test_lines_that_are_not_completed_steps(line: str) -> None:
    assert ProgressMatcher().match(line) is None


def test_default_pattern_is_linear_on_long_junk() -> None:
    matcher = ProgressMatcher()
    for junk in ("1 " * 20_000 + "x", "INFO:" * 20_000, "[" * 20_000, "2024-" * 20_000):
        assert matcher.match(junk) is None


def test_custom_pattern_first_group_is_the_step() -> None:
    matcher = ProgressMatcher(r".*global_step=(\d+)")
    assert matcher.match("epoch 2 global_step=1234 loss 1") == 1234
    assert matcher.match("Batch 5 Loss: 1") is None


@pytest.mark.parametrize(
    ("pattern", "problem"), [("(", "invalid regular expression"), (".*", "capture group")]
)
def test_bad_custom_pattern(pattern: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ProgressMatcher(pattern)
