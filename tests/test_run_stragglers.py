"""Stragglers in a real local run: light workers that each print ``Step N`` at their own
pace (no collectives), 2 nodes x 2 ranks, one rank throttled with ``--inject slow``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import SCRIPTS, Trainguard, write_job

WINDOW = 25


def run(tg: Trainguard, tmp_path: Path, *injections: str, **spec: Any) -> dict[str, Any]:
    """50 steps of 0.1 s on every rank; the job's events and faults once it is done."""
    command = ["python", str(SCRIPTS / "pace_worker.py"), "50", "0.1"]
    options = {"stragglerWindow": WINDOW, **spec.pop("trainguard", {})}
    job = write_job(tmp_path / "job.yaml", "pace", command, trainguard=options, **spec)
    inject = [arg for spec in injections for arg in ("--inject", spec)]
    done = tg.run("run", "-f", str(job), *inject, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return tg.only_job()


def stragglers(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in job["events"] if e["kind"] == "Straggler"]


def test_a_throttled_rank_is_reported_within_the_window(tg: Trainguard, tmp_path: Path) -> None:
    job = run(tg, tmp_path, "slow:rank=3@step=30")
    [injected] = [e for e in job["events"] if e["kind"] == "FaultInjected"]
    hit = injected["data"]["step"]
    [event] = stragglers(job)
    assert (event["rank"], event["node"]) == (3, "node-1"), event
    data = event["data"]
    assert (data["rank"], data["node"], data["window"]) == (3, "node-1", WINDOW)
    assert hit <= data["step"] <= hit + WINDOW, (hit, data)
    assert data["ratio"] >= 1.3
    assert data["seconds_per_step"] >= 1.3 * data["median_seconds_per_step"]
    assert event["message"].startswith("rank 3 (node-1) is a straggler: ")
    assert job["faults"] == []  # stragglerAction: report (the default) only reports


def test_no_straggler_without_a_slow_rank(tg: Trainguard, tmp_path: Path) -> None:
    assert stragglers(run(tg, tmp_path)) == []


def test_no_straggler_when_every_rank_slows_down_together(tg: Trainguard, tmp_path: Path) -> None:
    # Seconds-triggered: the controller throttles the four ranks at the same moment.
    job = run(tg, tmp_path, *(f"slow:rank={rank}@3s" for rank in range(4)))
    assert len([e for e in job["events"] if e["kind"] == "FaultInjected"]) == 4
    assert stragglers(job) == []


def test_with_restart_the_straggler_is_a_fault_and_its_node_is_replaced(
    tg: Trainguard, tmp_path: Path
) -> None:
    job = run(
        tg,
        tmp_path,
        "slow:rank=3@step=30",
        trainguard={"stragglerAction": "restart"},
        runPolicy={"jobMaxRetryCount": 1},
    )
    [fault] = job["faults"]
    assert (fault["type"], fault["rank"], fault["node"]) == ("Straggler", 3, "node-1")
    assert fault["evidence"]["injected"] == "slow:rank=3@step=30"
    assert fault["scope"] == "job"  # its node is replaced (here: a fresh agent, no spare)
    [restart] = [e for e in job["events"] if e["kind"] == "RestartScheduled"]
    assert "node-1 unusable after Straggler" in restart["message"]
    assert [a["phase"] for a in job["attempts"]] == ["Failed", "Succeeded"]
