"""The Grafana dashboard in deploy/grafana, read for tests: its panels and their queries."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "trainguard-dashboard.json"

METRICS: dict[str, str] = {
    "trainguard_jobs_created_total": "counter",
    "trainguard_jobs_successful_total": "counter",
    "trainguard_jobs_failed_total": "counter",
    "trainguard_jobs_deleted_total": "counter",
    "trainguard_jobs_restarted_total": "counter",
    "trainguard_jobs_restart_latency_seconds": "histogram",
    "trainguard_jobs_fault_detection_latency_seconds": "histogram",
    "trainguard_faults_total": "counter",
    "trainguard_downtime_seconds": "gauge",
    "trainguard_goodput_ratio": "gauge",
    "trainguard_lost_steps_total": "counter",
    "trainguard_step": "gauge",
    "trainguard_steps_per_second": "gauge",
    "trainguard_rank_steps_per_second": "gauge",
    "trainguard_checkpoint_save_blocking_seconds": "histogram",
    "trainguard_checkpoint_restore_seconds": "histogram",
    "trainguard_checkpoint_persist_lag_steps": "gauge",
    "trainguard_nodes": "gauge",
    "trainguard_hot_spares_ready": "gauge",
    "trainguard_stragglers_total": "counter",
}
"""trainguard's metric families (the names agreed for issue 17) and their types."""

HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
_METRIC = re.compile(r"\btrainguard_[a-z0-9_]+\b")


def load() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row, including those inside collapsed rows."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def concrete(expr: str, job: str, rate_interval: str = "30s") -> str:
    """``expr`` with the dashboard's variables replaced, as Grafana sends it."""
    return (
        expr.replace("${job}", job).replace("$job", job).replace("$__rate_interval", rate_interval)
    )


def family(series: str) -> str | None:
    """The metric family of a series name (``x_bucket`` -> ``x`` for histograms); None if
    it is none of trainguard's."""
    if series in METRICS:
        return series
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and METRICS.get(base) == "histogram":
            return base
    return None


def series_names(expr: str) -> list[str]:
    """The ``trainguard_*`` series names a query selects."""
    return _METRIC.findall(expr)
