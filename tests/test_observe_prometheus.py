"""Metrics seen through a real Prometheus (the Debian package, on loopback).

- the harness itself, against a small prometheus-client server of the test's own;
- every query of the Grafana dashboard parses (``promtool``);
- one local run (2 nodes x 1 rank of a small DDP job that checkpoints every step) with
  an injected kill and an injected hang, scraped every second while it runs and while
  its endpoint lingers: PromQL for restarts, faults by type, downtime and goodput gives
  what ``describe -o json`` reports, and every query of the dashboard returns series.

The run's values are read at Prometheus's last successful scrape of the run, which
came after the job ended (the endpoint lingers ``LINGER`` seconds, scraped every
second): the final values, not a sample taken before the last turn.
"""

from __future__ import annotations

import math
import subprocess
import time
from collections import Counter as Tally
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from conftest import SCRIPTS, Trainguard, write_job
from grafana_dashboard import concrete, load, queries
from prometheus_server import (
    HOST,
    Prometheus,
    PromQLError,
    prometheus_binary,
    running_prometheus,
)
from s3_server import free_port

__all__ = ["prometheus_binary"]  # a fixture, used by name

JOB = "observed"
LINGER = 5.0
"""Seconds the run's endpoint stays up after the job ends: a few scrapes of the end."""
HANG_SECONDS = 5
STEPS = 60
INJECTIONS = ("kill:rank=1@step=10", "hang:rank=0@step=30")
END_SLACK = 1e-6
"""The metrics and ``describe`` account the same samples up to the same end (the
controller's finish): equal but for how the exposition format prints a float."""


@pytest.fixture
def own_target() -> Iterator[tuple[str, Counter, Gauge]]:
    """A prometheus-client endpoint with one counter and one gauge, labelled like ours."""
    registry = CollectorRegistry()
    faults = Counter("demo_faults", "faults", ["job", "type"], registry=registry)
    goodput = Gauge("demo_goodput_ratio", "goodput", ["job"], registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr=HOST, registry=registry)
    try:
        yield f"{HOST}:{port}", faults, goodput
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_harness_scrapes_a_target_and_answers_promql(
    prometheus_binary: str, own_target: tuple[str, Counter, Gauge], tmp_path: Path
) -> None:
    target, faults, goodput = own_target
    faults.labels(job="ns/demo", type="WorkerCrash").inc(2)
    faults.labels(job="ns/demo", type="LogHang").inc()
    goodput.labels(job="ns/demo").set(0.8125)
    with running_prometheus(prometheus_binary, [target], tmp_path / "prom") as prom:
        assert isinstance(prom, Prometheus)
        by_type = prom.wait_for(
            'sum by (type) (demo_faults_total{job="ns/demo"})', lambda r: len(r) == 2
        )
        assert {labels["type"]: value for labels, value in by_type} == {
            "WorkerCrash": 2.0,
            "LogHang": 1.0,
        }
        # The target's own `job` label is kept (honor_labels), not renamed exported_job.
        [(labels, value)] = prom.query("demo_goodput_ratio")
        assert labels["job"] == "ns/demo" and value == 0.8125
        assert prom.label_values("job", "demo_goodput_ratio") == ["ns/demo"]
        goodput.labels(job="ns/demo").set(0.5)
        prom.wait_for('demo_goodput_ratio{job="ns/demo"}', lambda r: r[0][1] == 0.5)
        scraped = prom.last_scrape(target)
        assert scraped is not None and scraped <= time.time() + 1
        assert prom.query("scalar(vector(1))") == [({}, 1.0)]
        series = prom.query_range("demo_goodput_ratio", time.time() - 30, time.time())
        assert [labels["job"] for labels, _ in series] == ["ns/demo"]
        with pytest.raises(PromQLError, match="parse"):
            prom.query("sum by (type (demo_faults_total)")


def test_every_dashboard_query_parses(prometheus_binary: str, tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule), with the variables filled in."""
    promtool = Path(prometheus_binary).with_name("promtool")
    rules = [
        {"record": f"trainguard:dashboard_{i}", "expr": concrete(expr, JOB)}
        for i, (_, expr) in enumerate(queries(load()))
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [str(promtool), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout


# -- a scraped run --------------------------------------------------------------------------


@dataclass(frozen=True)
class ScrapedRun:
    """A finished run and the Prometheus that scraped it (still up)."""

    prom: Prometheus
    job: dict[str, Any]
    started: float
    last_scrape: float


def job_spec(tmp_path: Path) -> Path:
    command = [
        "python",
        str(SCRIPTS / "ckpt_worker.py"),
        *("--steps", str(STEPS), "--step-sleep", "0.1"),
    ]
    return write_job(
        tmp_path / "job.yaml",
        JOB,
        command,
        nprocPerNode=1,  # the hang stops node-0's only rank: the job's log goes quiet
        runPolicy={
            "jobMaxRetryCount": 3,
            "logMonitoringConfiguration": [
                {
                    "name": "JobHang",
                    "logPattern": ".*Loss:.*",
                    "expectedRecurringFrequencyInSeconds": HANG_SECONDS,
                }
            ],
        },
        checkpointing={"memoryKeep": 3, "durableEverySteps": 10},
    )


@pytest.fixture(scope="module")
def scraped_run(
    prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScrapedRun]:
    tmp = tmp_path_factory.mktemp("observed")
    tg = Trainguard(tmp / "state")
    port = free_port()
    target = f"{HOST}:{port}"
    args = ["run", "-f", str(job_spec(tmp))]
    for injection in INJECTIONS:
        args += ["--inject", injection]
    args += ["--metrics-port", str(port), "--metrics-linger", f"{LINGER:g}"]
    with running_prometheus(prometheus_binary, [target], tmp / "prometheus") as prom:
        started = time.time()
        done = tg.run(*args, timeout=600)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        job = tg.only_job()
        last = prom.last_scrape(target)
        assert last is not None, "Prometheus never scraped the run"
        # A scrape that began a second after the job's end saw its final values.
        assert last >= job["finished_at"] + 1.0, (last, job["finished_at"])
        yield ScrapedRun(prom, job, started, last)


@pytest.mark.e2e
@pytest.mark.exclusive  # the hang is found by a log rule's timer
def test_promql_gives_the_restarts_faults_downtime_and_goodput_describe_reports(
    scraped_run: ScrapedRun,
) -> None:
    prom, job, at = scraped_run.prom, scraped_run.job, scraped_run.last_scrape
    accounting = job["accounting"]
    injected = [e for e in job["events"] if e["kind"] == "FaultInjected"]
    assert len(injected) == len(INJECTIONS), injected

    [(_, restarts)] = prom.query(f'sum(trainguard_jobs_restarted_total{{job="{JOB}"}})', at)
    assert restarts == accounting["restarts"] == job["restarts"] == 2

    faults = prom.query(f'sum by (type) (trainguard_faults_total{{job="{JOB}"}})', at)
    by_type = {labels["type"]: value for labels, value in faults}
    assert by_type == accounting["faults"] == dict(Tally(f["type"] for f in job["faults"]))
    assert by_type == {"WorkerCrash": 1, "LogHang": 1}

    downtime = prom.query(f'trainguard_downtime_seconds{{job="{JOB}"}}', at)
    by_cause = {labels["cause"]: value for labels, value in downtime}
    expected = accounting["downtime_seconds"]
    assert set(by_cause) == set(expected)
    assert {"startup", "WorkerCrash", "LogHang"} <= set(expected)
    for cause, seconds in expected.items():
        assert by_cause[cause] == pytest.approx(seconds, abs=END_SLACK), cause

    [(_, goodput)] = prom.query(f'trainguard_goodput_ratio{{job="{JOB}"}}', at)
    wall = accounting["wall_seconds"]
    assert 0 < accounting["goodput"] < 1
    assert goodput == pytest.approx(accounting["goodput"], abs=END_SLACK / wall)


@pytest.mark.e2e
@pytest.mark.exclusive
def test_every_dashboard_query_returns_series_from_the_run(scraped_run: ScrapedRun) -> None:
    prom = scraped_run.prom
    assert prom.label_values("job", "trainguard_step") == [JOB]  # the $job variable's choices
    empty = []
    for title, expr in queries(load()):
        try:
            series = prom.query_range(
                concrete(expr, JOB), scraped_run.started, scraped_run.last_scrape
            )
        except PromQLError as err:
            empty.append(f"{title}: {expr}: {err}")
            continue
        values = [v for _, points in series for _, v in points]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr}: {len(series)} series, no value")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
