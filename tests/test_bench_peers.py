"""The peers scenario's parsing and tables (bench/peers), without any peer installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.peers import checkpoints, env, runner, table, worlds
from bench.peers.torchft_peer import DEFAULTS, TUNED
from bench.recovery import FaultRecord


def test_world_after_reads_the_step_that_ended_the_stall(tmp_path: Path) -> None:
    path = tmp_path / "worlds.txt"
    path.write_text(
        "q1 4 100.0\nq1 4 101.0\nq1 4 101.5\ntorn\nq3 3 104.0\nq3 3 105.0\nq4 4 107.5\nq4 4 108"
    )
    # fault at 101.2; the in-flight step (101.5) still ran at 4; the stall ended at 104.0
    found = worlds.world_after(path, 101.2, 2.8, 4)
    assert found == {"world_after": 3, "world_restored_s": 107.5 - 101.2}
    assert worlds.world_after(path, 101.2, None, 4) == {
        "world_after": None,
        "world_restored_s": None,
    }
    assert worlds.world_after(tmp_path / "missing", 1.0, 1.0, 4)["world_after"] is None


def test_world_after_at_full_size_is_restored_at_once(tmp_path: Path) -> None:
    path = tmp_path / "worlds.txt"
    path.write_text("i0 4 10.0\ni1 4 14.0\n")
    assert worlds.world_after(path, 11.0, 3.0, 4) == {"world_after": 4, "world_restored_s": 0.0}


def test_lighthouse_flags() -> None:
    assert DEFAULTS.argv() == []
    assert TUNED.argv()[:2] == ["--heartbeat_timeout_ms", "1000"]


def test_peer_requirements_pin_the_projects_torch() -> None:
    import torch

    assert env.torch_requirement() == "torch==" + torch.__version__.split("+")[0]
    assert env.REQUIREMENTS[0] == env.torch_requirement()
    assert set(env.PROBES) == set(env.PEERS) == set(env.DISTRIBUTIONS)


def _run(stall: float | None, lost: int | None, world: int | None) -> dict[str, Any]:
    record = FaultRecord(stall is not None, stall_s=stall, lost_steps=lost)
    return record.to_json() | {"detail": {"world_after": world}}


def test_ratios_pair_repetitions_where_both_recovered() -> None:
    result: dict[str, Any] = {
        "trainguard_checkpointless": {"runs": [_run(0.5, 0, 4), _run(0.7, 0, 4)]},
        "peer_torchft": {"runs": [_run(1.0, 0, 3), _run(None, None, None)]},
        "baseline_relaunch": {"runs": [_run(5.0, 5, 4), _run(7.0, 5, 4)]},
    }
    ratios = runner.peer_ratios(result)
    assert ratios["trainguard_checkpointless_stall_s_vs_peer_torchft"] == 0.5
    assert ratios["trainguard_checkpointless_stall_s_vs_baseline_relaunch"] == 0.6 / 6.0
    assert ratios["trainguard_checkpointless_lost_steps_vs_baseline_relaunch"] == 0.0


def test_checkpoint_figures_and_ratios() -> None:
    good = {"save_s": [0.1, 0.3], "restore_s": [0.2, 0.2], "identical": True}
    ours = checkpoints.figures([good, {"error": "boom"}])
    assert ours["save_s"]["median"] == 0.2 and ours["identical"] is True
    theirs = checkpoints.figures([{"save_s": [0.4], "restore_s": [1.0], "identical": True}])
    failed = checkpoints.figures([{"error": "TimeoutError: saver"}])
    assert failed["skipped"] == "TimeoutError: saver"
    ckpt = {"trainguard_memory": ours, "sagemaker": theirs, "dlrover": failed}
    ratios = runner.checkpoint_ratios(ckpt)
    assert ratios == {
        "trainguard_memory_save_s_vs_peer_sagemaker": 0.5,
        "trainguard_memory_restore_s_vs_peer_sagemaker": 0.2,
    }


def test_peers_table_has_a_row_per_side_and_the_skipped_reasons() -> None:
    def side(stall: float, lost: int, world: int) -> dict[str, Any]:
        stats = {"median": stall, "min": stall, "max": stall, "n": 1, "runs": 1}
        return {
            "stall_s": stats,
            "lost_steps": {"median": lost, "min": lost, "max": lost, "n": 1, "runs": 1},
            "world_after": {"median": world, "min": world, "max": world, "n": 1, "runs": 1},
            "world_restored_s": None,
            "recovered": 1,
            "runs": [_run(stall, lost, world)],
        }

    res: dict[str, Any] = {
        "trainguard_checkpointless": side(0.4, 0, 4),
        "trainguard": side(0.5, 5, 4),
        "peer_nvrx": side(4.0, 0, 4),
        "baseline_relaunch": side(8.0, 5, 4),
    }
    res["ratio"] = runner.peer_ratios(res)
    res["checkpoint"] = {
        "trainguard_memory": checkpoints.figures(
            [{"save_s": [0.1], "restore_s": [0.3], "identical": True}]
        ),
        "sagemaker": checkpoints.figures(
            [{"save_s": [0.5], "restore_s": [3.0], "identical": True}]
        ),
    }
    res["ratio"] |= runner.checkpoint_ratios(res["checkpoint"])
    res["skipped"] = {"peer_torchft": "does not import: no lighthouse"}
    res["setup"] = {"environment": {"versions": {"nvrx": "0.4.1", "sagemaker": "1.1.3"}}}
    text = table.peers_table(res)
    nvrx = next(line for line in text.splitlines() if line.startswith("| NVRx"))
    assert "0.4.1" in nvrx and "| 0.10 | 0.12 |" in nvrx  # 0.4 / 4.0, 0.5 / 4.0
    sagemaker = next(line for line in text.splitlines() if "SageMaker" in line)
    assert "| 0.20 | 0.10 |" in sagemaker
    assert "- torchft: does not import: no lighthouse" in text
    assert table.peers_table({"skipped": "no venv"}).endswith("no venv")
    assert table.peers_table(None) == ""


def test_a_torchft_step_that_ran_through_the_kill_ends_the_stall() -> None:
    from bench.recovery import from_steps
    from bench.steps import StepRecord

    records = [
        StepRecord("m2", 24, 10.0, 10.6),
        StepRecord("m2", 25, 10.6, 11.2),
        StepRecord("m3", 26, 11.2, 12.3),  # its quorum re-formed without the dead replica
        StepRecord("m3", 27, 12.3, 12.9),
    ]
    assert not from_steps(records, 11.3, None).recovered  # attributed to the fault
    record = from_steps(worlds.absorbed_steps(records, 11.3), 11.3, None)
    assert record.recovered and record.lost_steps == 0
    assert abs((record.stall_s or 0) - 1.0) < 1e-6
    assert worlds.absorbed_steps(records, None) == records
