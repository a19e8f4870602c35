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
from collections.abc import Callable, Collection
from pathlib import Path

from trainguard.health.kernel_log import KERNEL_LOG_ENV
from trainguard.health.monitors import HealthWatch
from trainguard.health.result import Finding
from trainguard.health.runner import run_checks
from trainguard.health.settings import MONITOR_KIND, HealthSettings
from trainguard.health.suite import Peers, continuous_watch, on_start_checks, set_disk_full
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
        # What the status says, rebuilt only when a check ends or a finding comes (every
        # status the agent serves or pushes carries it).
        self._report = HealthReport(deep="InProgress" if options.checks else None)
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
            return self._report

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
        reports = tuple(CheckReport(**r.to_json()) for r in results)
        deep = "Failed" if any(r.failed for r in results) else "Passed"
        with self._lock:
            self._report = self._report.model_copy(update={"deep": deep, "checks": reports})
        self._on_news()

    def _watch(self) -> HealthWatch | None:
        if not self.options.continuous:
            return None
        env = dict(os.environ)
        if self.hooks is not None:
            env[KERNEL_LOG_ENV] = str(self.hooks / HOOK_KERNEL_LOG)
        return continuous_watch(
            self.job_dir,
            expected_gpus=self.options.expected_gpus,
            disk_min_free_mib=self.options.min_free_disk_mib,
            shm_min_free_mib=self.options.min_free_shm_mib,
            env=env,
            only=[MONITOR_KIND[name] for name in self.options.continuous],
        )

    def _found(self, found: list[Finding]) -> None:
        with self._lock:
            findings = list(self._report.findings)
            for finding in found:
                logger.warning("health: %s: %s", finding.kind, finding.message)
                data = finding.to_json()
                data["time"] = data["time"] or time.time()
                findings.append(FindingReport(seq=self._next_seq, **data))
                self._next_seq += 1
            kept = tuple(findings[-MAX_FINDINGS:])  # the newest
            self._report = self._report.model_copy(update={"findings": kept})
        self._on_news()
