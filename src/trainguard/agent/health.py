"""The node's health in the agent: its on-start checks, then its monitors.

:class:`HealthKeeper` runs on a thread of its own, so neither a check (seconds) nor
nvidia-smi (up to seconds) holds the agent up:

1. the on-start (deep) checks the job asked for (``spec.trainguard.healthChecks.onStart``,
   :mod:`trainguard.health`), once, when the agent starts: the status says ``deep:
   InProgress`` meanwhile, and the controller gives the node no ranks until it says
   ``Passed``. ``connectivity`` runs with the job's other new nodes at the same time
   (``--health-peers``: this node's rank among them and where rank 0 hosts the test);
2. then the monitors (``continuous``) every second; each finding is numbered and kept
   (the newest :data:`~trainguard.wire.health.MAX_FINDINGS`), and pushed at once.

Rehearsal hooks (``--health-hooks DIR``; trainguard never writes to the real kernel
log): ``DIR/kernel.log`` is read like the kernel log, and ``DIR/disk-full`` existing
makes the space monitors report full. ``--health-fail NAME`` fails that check without
running it (``--inject health:node=N,check=NAME``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

from trainguard.health.kernel_log import KernelLogMonitor, default_sources
from trainguard.health.monitors import HealthWatch, MemoryPressureMonitor, Monitor, SpaceMonitor
from trainguard.health.nvsmi import NvidiaSmiMonitor
from trainguard.health.result import CheckResult, Finding
from trainguard.health.runner import run_checks
from trainguard.health.settings import HealthSettings
from trainguard.health.storage import SHM
from trainguard.health.suite import Peers, on_start_checks, set_disk_full
from trainguard.wire.health import MAX_FINDINGS, CheckReport, FindingReport, HealthReport

__all__ = ["HOOK_DISK_FULL", "HOOK_KERNEL_LOG", "HealthKeeper"]

logger = logging.getLogger(__name__)

HOOK_KERNEL_LOG = "kernel.log"
HOOK_DISK_FULL = "disk-full"
WATCH_INTERVAL = 1.0


class HealthKeeper:
    """See the module docstring. ``on_news``: the status changed (bump and push it)."""

    def __init__(
        self,
        options: HealthSettings,
        job_dir: str,
        on_news: Callable[[], None],
        *,
        peers: Peers | None = None,
        fail: Collection[str] = (),
        hooks: Path | None = None,
    ) -> None:
        self.options = options
        self.job_dir = job_dir
        self.peers = peers
        self.fail = frozenset(fail)
        self.hooks = hooks
        self._on_news = on_news
        self._lock = threading.Lock()
        self._deep: str | None = "InProgress" if options.checks else None
        self._checks: list[CheckResult] = []
        self._findings: deque[FindingReport] = deque(maxlen=MAX_FINDINGS)
        self._next_seq = 0
        self._stop = threading.Event()
        self.watching = threading.Event()  # the monitors run (they see what comes after)
        self._thread = threading.Thread(target=self._run, name="tg-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def report(self) -> HealthReport:
        with self._lock:
            return HealthReport(
                deep=self._deep,  # type: ignore[arg-type]
                checks=tuple(CheckReport(**c.to_json()) for c in self._checks),
                findings=tuple(self._findings),
            )

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        if self.options.checks:
            self._deep_checks()
        watch = self._watch()
        if watch is None:
            return
        self.watching.set()
        errors: dict[str, str] = {}
        try:
            while not self._stop.wait(WATCH_INTERVAL):
                if self.hooks is not None:
                    set_disk_full(watch, (self.hooks / HOOK_DISK_FULL).exists())
                found = watch.poll()
                if found:
                    self._found(found)
                if watch.errors != errors:
                    for name, error in watch.errors.items():
                        if errors.get(name) != error:
                            logger.warning("health monitor %s failed: %s", name, error)
                    errors = dict(watch.errors)
        finally:
            watch.close()

    def _deep_checks(self) -> None:
        checks = on_start_checks(self.options.suite(), self.job_dir, self.peers)
        fail = {name for name in self.fail if name in {c.name for c in checks}}
        for name in sorted(self.fail - fail):
            logger.warning("--health-fail %s: not among this job's on-start checks", name)
        results = run_checks(checks, fail)
        for result in results:
            logger.info("health check %s %s: %s", result.name, result.outcome, result.message)
        with self._lock:
            self._checks = results
            self._deep = "Failed" if any(r.failed for r in results) else "Passed"
        self._on_news()

    def _watch(self) -> HealthWatch | None:
        chosen = set(self.options.continuous)
        monitors: list[Monitor] = []
        if "kernelLog" in chosen:
            env = dict(os.environ)
            if self.hooks is not None:
                env["TRAINGUARD_KERNEL_LOG"] = str(self.hooks / HOOK_KERNEL_LOG)
            monitors.append(KernelLogMonitor(default_sources(env)))
        if "gpu" in chosen:
            monitors.append(NvidiaSmiMonitor(expected_gpus=self.options.expected_gpus))
        if "disk" in chosen:
            monitors.append(SpaceMonitor(self.job_dir, self.options.min_free_disk_mib, "replace"))
            if os.path.isdir(SHM):
                monitors.append(SpaceMonitor(SHM, self.options.min_free_shm_mib, "reboot"))
        if "memory" in chosen:
            monitors.append(MemoryPressureMonitor())
        return HealthWatch(monitors) if monitors else None

    def _found(self, found: list[Finding]) -> None:
        with self._lock:
            for finding in found:
                logger.warning("health: %s: %s", finding.kind, finding.message)
                data = finding.to_json()
                data["time"] = data["time"] or time.time()
                self._findings.append(FindingReport(seq=self._next_seq, **data))
                self._next_seq += 1
        self._on_news()
