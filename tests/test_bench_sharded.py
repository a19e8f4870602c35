"""The sharded benchmark's pure parts: the script and arguments its jobs run with, the
newest complete DCP checkpoint, and the scenario's results and rows, assembled from
synthetic records (``python -m bench --only sharded`` runs the real ones).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import TrainingJob

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench import recovery, sharded, suite  # noqa: E402
from bench.recovery import FaultRecord, FaultSetup, Variant  # noqa: E402
from bench.report import markdown  # noqa: E402
from bench.runs import TorchrunRun  # noqa: E402
from bench.sharded_train import latest_dcp  # noqa: E402


def test_both_launchers_run_the_sharded_script_in_its_layout(tmp_path: Path) -> None:
    args = suite.FULL.sharded.args("hsdp")
    assert TorchrunRun(tmp_path, args, run_id="r").args.script == sharded.SCRIPT
    argv = args.argv(tmp_path, "torch")
    assert argv[argv.index("--layout") + 1] == "hsdp" and "--ckpt-every" in argv
    captured: list[Any] = []

    def fault(run: Any, injection: str, timeout: float) -> FaultRecord:
        captured.append(run.job.spec(run.args, tmp_path))
        return FaultRecord(False)

    for name, variant in sharded.VARIANTS[:2]:  # the trainguard jobs, as they are written
        captured.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(recovery, "trainguard_fault", fault)
            variant(FaultSetup(tmp_path / name, args, 15))
        spec = TrainingJob.model_validate(captured[0]).spec
        assert spec.checkpointing.memory_every_steps == args.ckpt_every
        command = captured[0]["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
        assert command["command"][1] == str(sharded.SCRIPT)
        checkpointless = name == "trainguard_checkpointless"
        assert spec.trainguard.in_process_restart is checkpointless
        assert spec.trainguard.hot_spares == (1 if checkpointless else 0)


def test_a_relaunch_resumes_from_the_newest_complete_dcp_checkpoint(tmp_path: Path) -> None:
    assert latest_dcp(tmp_path) is None
    for step, complete in ((10, True), (20, True), (30, False)):  # 30: killed mid-save
        (tmp_path / f"step-{step}").mkdir()
        if complete:
            (tmp_path / f"step-{step}" / ".metadata").write_bytes(b"")
    assert latest_dcp(tmp_path) == (20, tmp_path / "step-20")


def record(stall: float, lost: int) -> FaultRecord:
    return FaultRecord(True, 15, 15 - lost, stall, lost, 0.05, step_at_fault=15)


def fixed(*records: FaultRecord) -> Variant:
    queue = list(records)
    return lambda setup: queue.pop(0)


def results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    plan = suite.QUICK.sharded
    runs = 2 * plan.repeats  # two layouts
    variants = [  # HSDP's checkpointless run first, then FSDP's (from the memory tier)
        ("trainguard", fixed(*(record(10.0, 5) for _ in range(runs)))),
        ("trainguard_checkpointless", fixed(record(1.0, 0), record(3.0, 5))),
        ("baseline_relaunch", fixed(*(record(20.0, 5) for _ in range(runs)))),
    ]
    monkeypatch.setattr(sharded, "VARIANTS", variants)
    for layout in sharded.LAYOUTS:  # every step 2 s: the redone steps' cost
        out = tmp_path / f"sharded-{layout}" / "trainguard-0" / "out"
        out.mkdir(parents=True)
        (out / "steps.txt").write_text("a.0 1 100.0 102.0\na.0 2 102.0 104.0\n")
    # FSDP's state size from its training runs, HSDP's from the save measurement
    (out / "state.json").write_text('{"state_bytes_per_rank": 9500000}')
    raw = {"state_bytes_per_rank": 19_000_000, "world": 4, "layout": "hsdp"}
    saves = {"trainguard_save_s": [0.05, 0.06, 0.9], "baseline_dcp_async_save_s": [0.2, 0.25]}

    def checkpoint(workdir: Path, layout: str, plan: Any) -> dict[str, Any]:
        if layout == "fsdp":
            return {"error": "bench/sharded_ckpt.py exited 1: boom"}
        return sharded.checkpoint_figures(raw | saves)

    monkeypatch.setattr(sharded, "checkpoint", checkpoint)
    return suite.sharded(suite.Context(suite.QUICK, tmp_path, lambda message: None))


def test_results_weigh_the_redone_steps_and_rows_judge_the_targets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    res = results(monkeypatch, tmp_path)
    hsdp, fsdp = res["hsdp"]["recovery"], res["fsdp"]["recovery"]
    assert res["hsdp"]["step_s"] == 2.0
    assert hsdp["baseline_relaunch"]["lost_s"]["median"] == 20.0 + 5 * 2.0
    assert hsdp["ratio"][sharded.RATIO] == pytest.approx(1.0 / 30.0)
    assert fsdp["ratio"][sharded.RATIO] == pytest.approx(13.0 / 30.0)
    assert res["hsdp"]["checkpoint"]["ratio"]["save_vs_dcp_async_save"] == pytest.approx(
        0.06 / 0.225
    )
    text = markdown({"sharded": res | {"wall_s": 60.0}})
    rows = [line for line in text.splitlines() if line.startswith("| sharded |")]
    [hsdp_row] = [
        r for r in rows if "HSDP 2x2 (19.0 MB/rank): stall + steps redone (checkpointless)" in r
    ]
    assert "| 0.03x | target <= 0.2x met |" in hsdp_row
    [fsdp_row] = [
        r for r in rows if "FSDP 1x4 (9.5 MB/rank): stall + steps redone (checkpointless)" in r
    ]
    assert "| 0.43x | target <= 0.5x met |" in fsdp_row
    [save] = [r for r in rows if "HSDP 2x2 (19.0 MB/rank): save() blocking" in r]
    assert "| DCP async_save |" in save and "target <= 0.5x met" in save
    assert any("FSDP 1x4" in r and "save() blocking" in r and "exited 1" in r for r in rows)
    process = [r for r in rows if "stall + steps redone (process-level restart)" in r]
    assert len(process) == 2 and all("0.67x | trainguard better" in r for r in process)


def test_a_missed_target_is_flagged() -> None:
    from bench.sharded_rows import judged

    assert judged(0.3, 0.2) == "**misses the <= 0.2x target**"
    assert judged(0.2, 0.2) == "target <= 0.2x met"
    assert judged(None, 0.2) == "—"


@pytest.mark.long
@pytest.mark.e2e
def test_the_relaunch_baseline_resumes_from_dcp_in_another_layout(tmp_path: Path) -> None:
    """bench/sharded_train.py --ckpt torch under torchrun: a second launch starts after the
    newest DCP checkpoint (written as HSDP, read as FSDP: DCP reshards) with the loss the
    uninterrupted run had."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}

    def launch(layout: str, steps: int, out: Path) -> list[str]:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "4", str(sharded.SCRIPT), "--layout", layout]
        argv += ["--steps", str(steps), "--ckpt", "torch", "--ckpt-every", "2"]
        argv += ["--hidden", "32", "--out", str(out)]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return [line for line in done.stdout.splitlines() if line.startswith("Batch ")]

    launch("hsdp", 3, tmp_path / "a")  # saves step 2; step 3 is lost
    resumed = launch("fsdp", 4, tmp_path / "a")
    whole = launch("hsdp", 4, tmp_path / "b")
    assert [line.split(",")[0] for line in resumed] == [line.split(",")[0] for line in whole[2:]]
