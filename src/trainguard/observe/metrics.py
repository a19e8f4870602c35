"""trainguard's Prometheus metrics, through ``prometheus-client``.

One :class:`Metrics` per process: the operator's covers every job it runs, a local
``trainguard run --metrics-port`` its one job. HyperPod's training-operator names where
they exist (``jobs_created_total`` ... ``jobs_fault_detection_latency``), under
``trainguard_``; every other series is trainguard's own. Labels are bounded: the job,
a fault type, a restart scope, a checkpoint tier, a node state, a rank (never a step).

:class:`JobMetrics` is one job's view: the platform hands it each turn's events and,
at most every :data:`~trainguard.observe.job.STATE_INTERVAL`, the job's state
(progress, accounting, nodes).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.aiohttp import make_aiohttp_handler

from trainguard.control.events import Event, EventKind
from trainguard.http_server import RouteServer
from trainguard.netlimits import ConnLimits
from trainguard.observe.gauges import JobState

__all__ = ["JobMetrics", "Metrics", "serve"]

PREFIX = "trainguard"
LATENCY_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CHECKPOINT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """Every metric, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no ``_created`` series beside every counter
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, labels, registry=r, buckets=buckets)

        # HyperPod's training-operator metrics.
        self.created = counter("jobs_created", "Jobs started.")
        self.successful = counter("jobs_successful", "Jobs that succeeded.")
        self.failed = counter("jobs_failed", "Jobs that failed or were stopped.")
        self.deleted = counter("jobs_deleted", "Jobs deleted.")
        self.restarted = counter("jobs_restarted", "Restarts, by scope.", "job", "scope")
        self.restart_latency = histogram(
            "jobs_restart_latency_seconds",
            "From a fault's detection to the first training step after the restart.",
            LATENCY_BUCKETS,
            "job",
        )
        self.fault_detection_latency = histogram(
            "jobs_fault_detection_latency_seconds",
            "From a fault (an injection, a pod's end) to the controller's decision.",
            LATENCY_BUCKETS,
            "job",
        )
        # trainguard's own.
        self.faults = counter(
            "faults", "Faults, by type and restart scope.", "job", "type", "scope"
        )
        self.downtime = gauge(
            "downtime_seconds", "Wall time without kept training steps, by cause.", "job", "cause"
        )
        self.goodput = gauge("goodput_ratio", "Wall time in kept steps / wall time.", "job")
        self.lost_steps = counter("lost_steps", "Completed steps lost to faults (redone).", "job")
        self.step = gauge("step", "The newest completed training step.", "job")
        self.steps_per_second = gauge("steps_per_second", "The job's training speed.", "job")
        self.rank_steps_per_second = gauge(
            "rank_steps_per_second", "Each rank's speed over its straggler window.", "job", "rank"
        )
        self.save_blocking = histogram(
            "checkpoint_save_blocking_seconds",
            "How long a checkpoint save blocked training, by tier.",
            CHECKPOINT_BUCKETS,
            "job",
            "tier",
        )
        self.restore_seconds = histogram(
            "checkpoint_restore_seconds",
            "How long a rank's checkpoint restore took, by the tier it came from.",
            CHECKPOINT_BUCKETS,
            "job",
            "tier",
        )
        self.persist_lag = gauge(
            "checkpoint_persist_lag_steps",
            "Steps between the newest memory-tier checkpoint and the newest durable one.",
            "job",
        )
        self.nodes = gauge("nodes", "The job's nodes, by state.", "job", "state")
        self.node_health = gauge(
            "node_health",
            "The job's nodes (current ones, and those it left) by HyperPod's node-health-status.",
            "job",
            "status",
        )
        self.hot_spares = gauge("hot_spares_ready", "Idle hot spare processes.", "job")
        self.stragglers = counter("stragglers", "Ranks found slower than their peers.", "job")

    def job(self, name: str) -> JobMetrics:
        return JobMetrics(self, name)


class JobMetrics:
    """One job's metrics (see the module docstring)."""

    def __init__(self, metrics: Metrics, job: str) -> None:
        self.m = metrics
        self.job = job
        self._ranks: set[str] = set()
        self._states: set[str] = set()
        self._health: set[str] = set()
        self._causes: set[str] = set()
        self._injected_at: float | None = None
        # Create the job's label sets now, so that a query sees zeros before any event.
        for family in (self.m.goodput, self.m.lost_steps, self.m.stragglers, self.m.step):
            family.labels(job)
        # And the memory tier's checkpoint series: a first batch of saves (or a first
        # restore) then shows as an increase.
        self.m.save_blocking.labels(job, "memory")
        self.m.restore_seconds.labels(job, "memory")

    def events(self, events: Iterable[Event]) -> None:
        """Count what the controller recorded (its events, in order)."""
        m, job = self.m, self.job
        for e in events:
            data = e.data
            if e.kind == EventKind.JOB_STARTED:
                m.created.inc()
            elif e.kind == EventKind.FAULT_INJECTED:
                self._injected_at = e.time
            elif e.kind == EventKind.FAULT:
                if self._injected_at is not None and data.get("evidence", {}).get("injected"):
                    self.detected(e.time - self._injected_at)
                    self._injected_at = None
            elif e.kind == EventKind.RESTART_SCHEDULED:
                m.restarted.labels(job, str(data.get("scope", ""))).inc()
            elif e.kind == EventKind.RECOVERED:
                _observe(m.restart_latency.labels(job), data.get("recovery_seconds"))
                lost = data.get("lost_steps")
                if isinstance(lost, int) and lost > 0:
                    m.lost_steps.labels(job).inc(lost)
            elif e.kind == EventKind.JOB_SUCCEEDED:
                m.successful.inc()
            elif e.kind == EventKind.JOB_FAILED:
                m.failed.inc()
            elif e.kind == EventKind.STRAGGLER:
                m.stragglers.labels(job).inc()
            elif e.kind == EventKind.CHECKPOINT_RESTORED:
                tier = str(data.get("tier", "unknown"))
                _observe(m.restore_seconds.labels(job, tier), data.get("seconds"))
            elif e.kind == EventKind.CHECKPOINT_SAVED:
                tier = str(data.get("tier", "memory"))
                for seconds in data.get("blocking_seconds", ()):
                    _observe(m.save_blocking.labels(job, tier), seconds)

    def detected(self, seconds: float) -> None:
        """A fault was decided on ``seconds`` after it happened."""
        _observe(self.m.fault_detection_latency.labels(self.job), max(0.0, seconds))

    def faults(self, records: Iterable[Mapping[str, object]]) -> None:
        """Count each fault of the timeline once its restart scope is known (``none``
        when no restart followed: the job failed or was stopped)."""
        for record in records:
            self.m.faults.labels(self.job, str(record.get("type")), str(record.get("scope"))).inc()

    def state(self, state: JobState) -> None:
        m, job, acc = self.m, self.job, state.accounting
        goodput = acc.goodput
        if goodput is not None:
            m.goodput.labels(job).set(goodput)
        self._causes = _set_all(m.downtime, job, acc.downtime_seconds(), self._causes)
        if state.step is not None:
            m.step.labels(job).set(state.step)
        if state.steps_per_second is not None:
            m.steps_per_second.labels(job).set(state.steps_per_second)
        if state.rank_steps_per_second is not None:
            speeds = {str(rank): v for rank, v in state.rank_steps_per_second.items()}
            self._ranks = _set_all(m.rank_steps_per_second, job, speeds, self._ranks)
        if state.nodes is not None:
            self._states = _set_all(m.nodes, job, state.nodes, self._states)
        if state.health is not None:
            self._health = _set_all(m.node_health, job, state.health, self._health)
        if state.persist_lag_steps is not None:
            m.persist_lag.labels(job).set(state.persist_lag_steps)
        if state.hot_spares is not None:
            m.hot_spares.labels(job).set(state.hot_spares)

    def forget(self) -> None:
        """The job is gone (deleted): drop its gauges (counters stay, as Prometheus expects)."""
        m, job = self.m, self.job
        for gauge in (m.goodput, m.step, m.steps_per_second, m.persist_lag, m.hot_spares):
            _remove(gauge, job)
        for family, keys in (
            (m.downtime, self._causes),
            (m.rank_steps_per_second, self._ranks),
            (m.nodes, self._states),
            (m.node_health, self._health),
        ):
            for key in keys:
                _remove(family, job, key)


def _observe(histogram: Histogram, value: object) -> None:
    if isinstance(value, int | float) and math.isfinite(value) and value >= 0:
        histogram.observe(float(value))


def _set_all(
    family: Gauge, job: str, values: Mapping[str, float] | Mapping[str, int], had: set[str]
) -> set[str]:
    """Set ``family{job, key}`` for each key; zero the keys set before and absent now."""
    for key in had - set(values):
        family.labels(job, key).set(0)
    for key, value in values.items():
        family.labels(job, key).set(value)
    return had | set(values)


def _remove(family: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set
        family.remove(*labels)


def serve(
    metrics: Metrics, port: int, host: str = "127.0.0.1", limits: ConnLimits | None = None
) -> RouteServer:
    """Serve ``GET /metrics`` on its own thread; ``.close()`` stops it. ``port`` 0 picks a
    free one (``server.port``)."""
    handler = make_aiohttp_handler(metrics.registry)
    return RouteServer(host, port, [web.get("/metrics", handler)], name="tg-metrics", limits=limits)
