"""The workloads benchmark's pure parts: the scripts and arguments each workload runs with,
the nested state it checkpoints, and the scenario's results, rows and table, assembled
from synthetic records (``python -m bench --only workloads`` runs the real ones).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.spec import TrainingJob

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench import suite, workloads  # noqa: E402
from bench.recovery import FaultRecord, Variant  # noqa: E402
from bench.report import markdown  # noqa: E402
from bench.runs import TRAIN, TorchrunRun  # noqa: E402
from bench.workloads_ckpt import tensors  # noqa: E402
from bench.workloads_rows import workloads_table  # noqa: E402


def test_each_workload_runs_its_own_script_under_both_launchers(tmp_path: Path) -> None:
    gpt, wide = suite.FULL.workloads.workloads
    spec = workloads.TrainguardJob("w").spec(gpt.args, tmp_path)
    TrainingJob.model_validate(spec)
    command = spec["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"]
    assert command[1] == str(workloads.GPT_SCRIPT) and "--ckpt" in command
    assert wide.args.script == TRAIN  # the wide MLP is bench/train.py at another width
    argv = wide.args.argv(tmp_path, "torch")
    assert argv[argv.index("--hidden") + 1] == "5120" and argv[-2:] == ["--global-batch", "16"]
    assert TorchrunRun(tmp_path, gpt.args, run_id="r").args.script == workloads.GPT_SCRIPT
    # Settings stay JSON (results.json keeps them), the scripts as paths relative to the repo.
    plan = json.loads(json.dumps(suite.FULL.to_json()))["workloads"]
    assert [w["name"] for w in plan["workloads"]] == ["gpt", "mlp_wide"]
    assert suite.FULL.workloads.to_json()["workloads"][0]["script"] == "bench/workloads_gpt.py"


def test_the_jobs_hang_rule_outlasts_a_slow_step() -> None:
    names = [fn.__module__ for name, fn in workloads.VARIANTS if name.startswith("trainguard")]
    assert names == ["bench.workloads", "bench.workloads"]  # their jobs use the rule below
    rules = workloads.log_rules(workloads.HANG_RULE_SECONDS)
    [hang] = [r for r in rules if r["name"] == "JobHangingDetection"]
    assert hang["expectedRecurringFrequencyInSeconds"] == workloads.HANG_RULE_SECONDS >= 30


def test_the_checkpointed_tensors_are_the_models_and_the_optimizers() -> None:
    net = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    optim.step()
    state = {"model": net.state_dict(), "optim": optim.state_dict(), "step": 1}
    found = list(tensors(state))
    # 2 parameters; per parameter AdamW keeps step, exp_avg and exp_avg_sq
    assert len(found) == 2 + 2 * 3
    assert found[0] is state["model"]["weight"]


def record(stall: float, lost: int) -> FaultRecord:
    return FaultRecord(True, 15, 15 - lost, stall, lost, 0.05, step_at_fault=15)


def fixed(*records: FaultRecord) -> Variant:
    queue = list(records)
    return lambda setup: queue.pop(0)


CKPT = {
    "state_bytes": 212_000_000,
    "state_tensors": 12,
    "trainguard_save_s": {"median": 0.2, "min": 0.19, "max": 0.3},
    "baseline_memcpy_s": {"median": 0.1, "min": 0.1, "max": 0.1},
    "baseline_torch_save_s": {"median": 2.0, "min": 2.0, "max": 2.0},
    "trainguard_restore_memory_s": {"median": 1.0, "min": 1.0, "max": 1.0},
    "trainguard_restore_durable_s": {"median": 8.0, "min": 8.0, "max": 8.0},
    "baseline_torch_load_s": {"median": 1.0, "min": 1.0, "max": 1.0},
    "ratio_save_vs_memcpy": 2.0,
    "ratio_save_vs_torch_save": 0.1,
    "ratio_restore_memory_vs_durable": 0.125,
    "ratio_restore_memory_vs_torch_load": 1.0,
}


def workloads_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    runs = 2 * suite.FULL.workloads.repeats  # two workloads
    variants = [
        ("trainguard", fixed(*(record(2.0, 5) for _ in range(runs)))),
        ("trainguard_checkpointless", fixed(*(record(1.0, 0) for _ in range(runs)))),
        ("baseline_relaunch", fixed(*(record(20.0, 5) for _ in range(runs)))),
    ]
    monkeypatch.setattr(workloads, "VARIANTS", variants)
    calls: list[tuple[str, ...]] = []

    def checkpoint(ctx: suite.Context, w: workloads.Workload, repeats: int) -> dict[str, Any]:
        calls.append(w.ckpt_argv)
        return CKPT if w.name != "gpt" else {"error": "python -m bench.workloads_ckpt exited 1"}

    monkeypatch.setattr(workloads, "checkpoint", checkpoint)
    res = suite.workloads(suite.Context(suite.FULL, tmp_path, lambda message: None))
    assert calls[-1] == workloads.REFERENCE  # the small MLP's, measured the same way
    return res


def test_results_hold_each_workloads_recovery_and_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    res = workloads_results(monkeypatch, tmp_path)
    wide = res["mlp_wide"]
    ratios = wide["recovery"]["ratio"]
    assert ratios["stall_s_vs_baseline_relaunch"] == pytest.approx(0.1)
    assert ratios["trainguard_checkpointless_stall_s_vs_baseline_relaunch"] == pytest.approx(0.05)
    assert wide["recovery"]["setup"]["workload"] == "mlp_wide"
    assert wide["step_s"]["n"] == 0  # no step records: no step time, not a made-up one
    assert wide["checkpoint"] is CKPT and res[workloads.REFERENCE_KEY] is CKPT
    assert res["setup"]["hang_rule_s"] == workloads.HANG_RULE_SECONDS


def test_rows_and_table_name_the_workload(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    res = workloads_results(monkeypatch, tmp_path) | {"wall_s": 900.0}  # as python -m bench
    text = markdown({"workloads": res})
    rows = [line for line in text.splitlines() if line.startswith("| workloads |")]
    [stall] = [r for r in rows if "mlp_wide: stall" in r and "checkpointless" in r]
    assert "| relaunch | 20.0 s | 0.05x | trainguard better |" in stall
    [copy] = [r for r in rows if "212 MB state): save() blocking | " in r and "plain copy" in r]
    assert "| 2.00x | **trainguard worse** |" in copy
    assert any("gpt: checkpoint" in r and "exited 1" in r for r in rows)
    table = workloads_table({"workloads": res})
    head, _, *lines = table.splitlines()
    assert head == "| | small MLP | gpt | mlp_wide |"
    [state] = [line for line in lines if line.startswith("| state per rank |")]
    assert state == "| state per rank | 212 MB (12 tensors) | — | 212 MB (12 tensors) |"
    [save] = [line for line in lines if line.startswith("| save() blocking / plain copy |")]
    assert save.endswith("| 200 ms / 100 ms (2.00x) |")
    assert "Other workloads" in text  # the report carries the table
