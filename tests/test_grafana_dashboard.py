"""The Grafana dashboard (deploy/grafana) is well formed and asks only for our metrics.

Pure: the JSON and the provisioning YAML are read, nothing runs. That every query
parses and returns series is checked against a real Prometheus in
``test_observe_prometheus.py``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from grafana_dashboard import (
    DASHBOARD,
    HISTOGRAM_SERIES,
    METRICS,
    concrete,
    family,
    load,
    panels,
    queries,
    series_names,
)

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
ROWS = ["Progress", "Faults and recovery", "Checkpoints", "Nodes"]
OPERATOR_WIDE = {
    "trainguard_jobs_created_total",
    "trainguard_jobs_successful_total",
    "trainguard_jobs_failed_total",
    "trainguard_jobs_deleted_total",
}
"""Counters without a ``job`` label: not on a one-job dashboard."""
VARIABLES = {"$job", "$__rate_interval"}
SELECTOR = re.compile(r"\b(trainguard_[a-z0-9_]+)\s*(\{[^}]*\})?")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load()


def test_it_is_a_provisionable_dashboard_model(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert "id" not in dashboard or dashboard["id"] is None  # provisioning assigns it
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["DS_PROMETHEUS"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and job["datasource"] == DATASOURCE
    assert job["definition"] == "label_values(trainguard_step, job)"
    assert job["query"]["query"] == job["definition"]


def test_one_row_each_for_progress_faults_checkpoints_and_nodes(
    dashboard: dict[str, Any],
) -> None:
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ROWS
    # Each row has panels under it (before the next row).
    kinds = [p["type"] for p in dashboard["panels"]]
    starts = [i for i, kind in enumerate(kinds) if kind == "row"]
    for start, end in zip(starts, [*starts[1:], len(kinds)], strict=True):
        assert end - start > 1, f"row {dashboard['panels'][start]['title']!r} is empty"


def test_every_panel_has_the_datasource_and_queries(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels(dashboard):
        title = panel["title"]
        assert panel["datasource"] == DATASOURCE, title
        assert panel["targets"], f"{title}: no queries"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{title}: refIds repeat"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, title
            assert target["expr"].strip(), f"{title}: empty query"


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[x, y]}"
                taken[x, y] = panel["title"]


def test_every_metric_a_query_names_is_one_of_ours(dashboard: dict[str, Any]) -> None:
    used = set()
    for title, expr in queries(dashboard):
        names = series_names(expr)
        assert names, f"{title}: {expr} names no trainguard metric"
        for name in names:
            base = family(name)
            assert base is not None, f"{title}: {name} is not a trainguard metric"
            if METRICS[base] == "histogram":
                assert name.endswith(HISTOGRAM_SERIES), f"{title}: {name} (a histogram)"
            used.add(base)
    assert used == set(METRICS) - OPERATOR_WIDE


def test_every_selector_is_for_the_chosen_job(dashboard: dict[str, Any]) -> None:
    for title, expr in queries(dashboard):
        for match in SELECTOR.finditer(expr):
            assert match.group(2) and 'job="$job"' in match.group(2), f"{title}: {expr}"
        assert set(re.findall(r"\$\{?\w+\}?", expr)) <= VARIABLES, f"{title}: {expr}"
        assert "$" not in concrete(expr, "demo"), expr
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")


def test_quantiles_are_taken_over_buckets_by_le(dashboard: dict[str, Any]) -> None:
    for title, expr in queries(dashboard):
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), f"{title}: {expr}"


def test_the_provisioning_files_point_at_the_dashboard() -> None:
    provisioning = DASHBOARD.parent / "provisioning"
    [source] = yaml.safe_load(
        (provisioning / "datasources" / "trainguard-prometheus.yaml").read_text()
    )["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "trainguard.yaml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"]
