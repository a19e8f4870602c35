"""``bench.checkpoint`` at a tiny size: the spaced saves, the CUDA part (or why it is
absent), the figures it always had, and the table rows built from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench.checkpoint import NO_CUDA, PER_CALL_GOAL_S, SPACED_GOAL  # noqa: E402
from bench.table_rows import checkpoint_rows  # noqa: E402

SPACED_SAVES = 3


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _positive_stats(stats: Any) -> bool:
    return isinstance(stats, dict) and all(_positive(stats[k]) for k in ("median", "min", "max"))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the benchmark in its own process (it starts and ends a gloo group)."""
    tmp = tmp_path_factory.mktemp("bench-checkpoint")
    out = tmp / "checkpoint.json"
    argv = [
        "--sizes", "8", "--repeats", "1",
        "--spaced-size", "8", "--spaced-saves", str(SPACED_SAVES), "--spacing", "0.05",
        "--cuda-sizes", "8", "--per-call-sizes", "0.5", "--per-call-tensors", "12",
        "--per-call-repeats", "2", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.checkpoint", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def test_the_spaced_saves_are_measured_against_a_plain_copy(results: dict[str, Any]) -> None:
    spaced = results["spaced"]
    assert spaced["size"] == "8MiB" and spaced["bytes"] == 8 << 20
    assert spaced["saves"] == SPACED_SAVES and spaced["spacing_s"] == 0.05
    assert _positive(spaced["spaced_first_save_s"])
    assert _positive_stats(spaced["spaced_save_s"])
    assert _positive_stats(spaced["spaced_memcpy_s"])
    times = spaced["spaced_save_times_s"]
    assert len(times) == SPACED_SAVES and times[0] == spaced["spaced_first_save_s"]
    assert spaced["spaced_save_s"]["min"] == min(times[1:])
    assert spaced["spaced_save_s"]["max"] == max(times[1:])
    median_copy = spaced["spaced_memcpy_s"]["median"]
    assert spaced["ratio_spaced_save_vs_memcpy"] == pytest.approx(
        spaced["spaced_save_s"]["median"] / median_copy
    )
    assert spaced["ratio_first_save_vs_memcpy"] == pytest.approx(times[0] / median_copy)
    assert spaced["goal_ratio_spaced_save_vs_memcpy"] == SPACED_GOAL


def test_the_cpu_figures_are_still_there(results: dict[str, Any]) -> None:
    figures = results["8MiB"]
    for key in (
        "trainguard_save_s",
        "baseline_memcpy_s",
        "baseline_torch_save_s",
        "baseline_dcp_async_save_s",
    ):
        assert _positive_stats(figures[key]), key
    for key in ("ratio_save_vs_torch_save", "ratio_bandwidth_vs_memcpy"):
        assert _positive(figures[key]), key


def test_the_cuda_part_says_why_it_is_absent_or_restores_bit_identical(
    results: dict[str, Any],
) -> None:
    if not torch.cuda.is_available():
        assert results["cuda"] == NO_CUDA == "no CUDA device"
        return
    figures = results["cuda"]["8MiB"]
    assert "error" not in figures, figures.get("error")
    for key in (
        "cuda_save_s",
        "cuda_save_nonblocking_s",
        "cuda_save_nonblocking_complete_s",
        "baseline_pinned_copy_s",
        "baseline_pageable_copy_s",
        "baseline_torch_save_s",
        "cuda_restore_s",
    ):
        assert _positive_stats(figures[key]), key
    for key in ("ratio_cuda_save_vs_pinned_copy", "ratio_cuda_save_vs_pageable_copy"):
        assert _positive(figures[key]), key
    assert figures["cuda_restore_tier"] == "memory"
    assert figures["cuda_restore_identical"] is True


def test_the_table_has_the_spaced_rows_and_the_cuda_state(results: dict[str, Any]) -> None:
    rows = checkpoint_rows(results)
    metrics = [row.metric for row in rows]
    assert "8MiB: save() blocking" in metrics  # the rows it always had
    goal = [row for row in rows if row.baseline == "goal" and "spaced" in row.metric]
    assert len(goal) == 1 and goal[0].theirs == f"<= {SPACED_GOAL:.2f}x"
    assert any(m.startswith("8MiB: first save() blocking, no load_latest") for m in metrics)
    assert any(m.startswith("8MiB: later save() blocking, no load_latest") for m in metrics)
    cuda = [row for row in rows if "CUDA" in row.metric]
    if not torch.cuda.is_available():
        assert [(r.metric, r.verdict) for r in cuda] == [
            ("CUDA state", "not measured: no CUDA device")
        ]
    else:
        assert any(r.verdict == "bit-identical" for r in cuda)


def test_the_per_call_cost_of_a_state_of_many_tensors_is_measured(results: dict[str, Any]) -> None:
    figures = results["per_call"]["0.5MB"]
    assert figures["tensors"] == 12  # 3 parameters: each, its two moments and a step
    assert 0.45e6 < figures["bytes"] < 0.55e6
    for key in ("per_call_save_s", "per_call_copy_s"):
        assert _positive_stats(figures[key]), key
    assert figures["ratio_per_call_save_vs_copy"] == pytest.approx(
        figures["per_call_save_s"]["median"] / figures["per_call_copy_s"]["median"]
    )
    assert figures["goal_per_call_save_s"] == PER_CALL_GOAL_S
    rows = [r for r in checkpoint_rows(results) if r.metric.startswith("0.5MB state of 12 tensors")]
    assert [r.baseline for r in rows] == ["plain copy", "goal"]
