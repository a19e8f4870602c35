"""The operator's Prometheus metrics, served as text on ``GET /metrics``.

A few counters and histograms need no client library: this module keeps them in
memory (thread-safe) and renders the text exposition format (version 0.0.4).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LatencyBuckets = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Counter:
    def __init__(self, name: str, help_text: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help_text, label
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def inc(self, label_value: str = "", amount: float = 1.0) -> None:
        with self._lock:
            self._values[label_value] = self._values.get(label_value, 0.0) + amount

    def value(self, label_value: str = "") -> float:
        with self._lock:
            return self._values.get(label_value, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            values = dict(self._values) or {"": 0.0}
        for label_value, value in sorted(values.items()):
            labels = f'{{{self.label}="{label_value}"}}' if self.label and label_value else ""
            lines.append(f"{self.name}{labels} {value:g}")
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LatencyBuckets):
        self.name, self.help = name, help_text
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        if math.isnan(value) or value < 0:
            return
        with self._lock:
            self._sum += value
            for i, bound in enumerate((*self.buckets, math.inf)):
                if value <= bound:
                    self._counts[i] += 1

    @property
    def count(self) -> int:
        with self._lock:
            return self._counts[-1]

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            counts, total = list(self._counts), self._sum
        for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
            le = "+Inf" if bound == math.inf else f"{bound:g}"
            lines.append(f'{self.name}_bucket{{le="{le}"}} {count}')
        lines += [f"{self.name}_sum {total:g}", f"{self.name}_count {counts[-1]}"]
        return lines


class OperatorMetrics:
    """Everything the operator counts (HyperPod's operator metrics, under ``trainguard_``)."""

    def __init__(self) -> None:
        self.created = Counter("trainguard_jobs_created_total", "TrainingJobs started.")
        self.succeeded = Counter("trainguard_jobs_succeeded_total", "TrainingJobs succeeded.")
        self.failed = Counter("trainguard_jobs_failed_total", "TrainingJobs failed or stopped.")
        self.deleted = Counter("trainguard_jobs_deleted_total", "TrainingJobs deleted.")
        self.restarted = Counter(
            "trainguard_jobs_restarted_total", "Restarts, by scope (process|job).", "scope"
        )
        self.faults = Counter("trainguard_faults_total", "Faults detected, by type.", "type")
        self.fault_detection_latency = Histogram(
            "trainguard_fault_detection_latency_seconds",
            "From a pod's end to the operator's fault (lost pods).",
        )
        self.restart_latency = Histogram(
            "trainguard_restart_latency_seconds",
            "From a fault's detection to the first training step after the restart.",
        )

    def render(self) -> str:
        lines: list[str] = []
        for metric in (
            self.created,
            self.succeeded,
            self.failed,
            self.deleted,
            self.restarted,
            self.faults,
            self.fault_detection_latency,
            self.restart_latency,
        ):
            lines += metric.render()
        return "\n".join(lines) + "\n"


def serve_metrics(
    metrics: OperatorMetrics, port: int, host: str = "0.0.0.0"
) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` on a daemon thread; returns the server (``.shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
