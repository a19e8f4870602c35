"""The hosts benchmark's pure parts: its job, torchrun's static form, the detection of a
lost node, and the scenario's results and rows, assembled from synthetic records.

No namespace hosts and no training here: the variants are replaced by functions that
return records (the real ones need root; ``python -m bench --only hosts`` runs them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import TrainingJob, resolve_plan

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench import suite  # noqa: E402
from bench.hosts import after_lost, hosts_job, lost_detection, torchrun_argv  # noqa: E402
from bench.recovery import FaultRecord, Variant  # noqa: E402
from bench.report import markdown  # noqa: E402
from bench.runs import TrainArgs  # noqa: E402


def test_the_job_has_a_spare_and_a_hang_rule_longer_than_a_lost_node() -> None:
    spec = hosts_job().spec(TrainArgs(steps=60), Path("/tmp/out"))
    job = TrainingJob.model_validate(spec)
    assert job.spec.replica_specs[0].spares == 1
    plan = resolve_plan(job, "bench")
    assert (plan.nnodes, plan.nproc_per_node) == (2, 2)
    [hang] = [r for r in spec["spec"]["runPolicy"]["logMonitoringConfiguration"]
              if r["name"] == "JobHangingDetection"]  # fmt: skip
    assert hang["expectedRecurringFrequencyInSeconds"] > 8  # nodeLostAfterSeconds across hosts


def test_the_time_after_a_lost_node_is_split_at_the_controllers_events() -> None:
    job = {
        "faults": [{"type": "NodeLost", "detected_at": 108.5}],
        "events": [
            {"kind": "AttemptEnded", "time": 50.0},  # an earlier attempt's: not this one
            {"kind": "AttemptEnded", "time": 109.0},
            {"kind": "AttemptStarted", "time": 109.5},
            {"kind": "Recovered", "time": 112.5},
        ],
    }
    assert after_lost(job) == {"stop": 0.5, "launch": 0.5, "start": 3.0}
    job["events"] = job["events"][:2]  # never recovered
    assert after_lost(job) == {"stop": 0.5}
    assert after_lost({"faults": [], "events": []}) == {}


def test_torchrun_static_form_meets_at_host_0() -> None:
    argv = torchrun_argv(
        "10.1.2.2", 1, 29601, "relaunch1", TrainArgs(steps=5), Path("o"), Path("c")
    )
    joined = " ".join(argv)
    assert "--nnodes 2 --nproc-per-node 2 --node-rank 1" in joined
    assert "--master-addr 10.1.2.2 --master-port 29601 --rdzv-id relaunch1" in joined
    assert "--ckpt torch" in joined and argv[-2:] == ["--ckpt-dir", "c"]
    assert "--rdzv-backend" not in argv  # static rendezvous: torchrun's default with a master


def test_a_lost_node_is_detected_from_the_injection_to_the_first_node_lost() -> None:
    job = {
        "events": [
            {"kind": "JobStarted", "time": 90.0},
            {"kind": "FaultInjected", "time": 100.0},
        ],
        "faults": [
            {"type": "LogHang", "detected_at": 104.0},
            {"type": "NodeLost", "detected_at": 108.5},
            {"type": "NodeLost", "detected_at": 130.0},
        ],
    }
    assert lost_detection(job) == pytest.approx(8.5)
    assert lost_detection({**job, "faults": job["faults"][:1]}) is None


def record(stall: float | None, lost: int | None = 5, detect: float | None = 0.05) -> FaultRecord:
    if stall is None:
        return FaultRecord(False, 25, note="> 120 s: no step after the cut within the cap")
    return FaultRecord(True, 25, 20, stall, lost, detect, step_at_fault=25)


def fixed(*records: FaultRecord) -> Variant:
    """A variant that returns ``records`` in turn."""
    queue = list(records)
    return lambda setup: queue.pop(0)


def hosts_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    kill = [
        ("trainguard", fixed(record(1.0), record(1.2), record(1.1))),
        ("baseline_one_host", fixed(record(0.8), record(0.9), record(1.0))),
        ("baseline_relaunch", fixed(*(record(20.0, detect=5.0) for _ in range(3)))),
    ]
    cut = [
        ("trainguard", fixed(*(record(15.0, 25, 8.5) for _ in range(3)))),
        ("baseline_one_host", fixed(*(record(8.0, 25, 0.5) for _ in range(3)))),
        ("baseline_relaunch_at_cut", fixed(*(record(30.0, detect=None) for _ in range(3)))),
        ("baseline_torchrun", fixed(record(None))),  # capped: one repetition
    ]
    monkeypatch.setattr(suite, "HOSTS_KILL_VARIANTS", kill)
    monkeypatch.setattr(suite, "HOSTS_CUT_VARIANTS", cut)
    monkeypatch.setattr(suite, "hosts_unavailable", lambda: None)
    ctx = suite.Context(suite.FULL, tmp_path, lambda message: None)
    return suite.hosts(ctx)


def test_results_pair_each_fault_with_its_baselines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    res = hosts_results(monkeypatch, tmp_path)
    assert res["kill"]["ratio"]["stall_s_vs_baseline_relaunch"] == pytest.approx(1.1 / 20.0)
    assert res["kill"]["ratio"]["stall_s_vs_baseline_one_host"] == pytest.approx(1.1 / 0.9)
    cut = res["cut"]
    assert cut["setup"]["capped_baselines"] == ["baseline_torchrun"]
    assert cut["baseline_torchrun"]["recovered"] == 0 and len(cut["baseline_torchrun"]["runs"]) == 1
    cap = suite.FULL.hosts_cap  # the cut's own cap (a restart across hosts may take long)
    assert cut["setup"]["cap_s"] == cap
    assert cut["ratio"]["stall_s_vs_baseline_torchrun_at_most"] == pytest.approx(15.0 / cap)
    assert cut["ratio"]["detect_s_vs_baseline_torchrun_at_most"] == pytest.approx(8.5 / cap)
    assert res["setup"]["hosts"] == 3 and res["setup"]["node_lost_after_s"] == 8.0


def test_rows_name_the_fault_and_the_baselines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lines = markdown({"hosts": hosts_results(monkeypatch, tmp_path)}).splitlines()
    rows = [line for line in lines if line.startswith("| hosts |")]
    [one_host] = [r for r in rows if "SIGKILLed: stall" in r and "on one host" in r]
    assert "1.22x" in one_host and "more across hosts" in one_host
    [relaunch] = [r for r in rows if "SIGKILLed: stall" in r and "relaunched" in r]
    assert "20.0 s" in relaunch and "trainguard better" in relaunch
    [capped] = [r for r in rows if "cut -> NodeLost" in r and "once one exits" in r]
    assert "none within the 120 s cap" in capped and "< 0.07x" in capped
    [lost] = [r for r in rows if "cut off: steps lost" in r and "once one exits" in r]
    assert lost.endswith("| none within the 120 s cap | — | — |")
    # A relaunch told at the cut has no detection to compare.
    assert not [r for r in rows if "NodeLost" in r and "told at the cut" in r]
    [told] = [r for r in rows if "cut off: stall" in r and "told at the cut" in r]
    assert "30.0 s" in told and "0.50x" in told
    assert any("hosts (cut), baseline_torchrun: > 120 s" in line for line in lines)  # a note


def test_a_machine_without_namespace_hosts_skips_the_scenario_saying_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(suite, "hosts_unavailable", lambda: "namespace hosts need root")
    res = suite.hosts(suite.Context(suite.QUICK, tmp_path, lambda message: None))
    assert res == {"skipped": "namespace hosts need root"}
    text = markdown({"hosts": res})
    assert "| hosts | every figure |" in text and "not measured: namespace hosts need root" in text
    assert "hosts" in suite.SCENARIOS
