"""The node health agent: one per Kubernetes Node (the DaemonSet of
:mod:`trainguard.kube.health_manifests`), labelling and tainting its own Node.

    python -m trainguard.kube.health_agent [--node NAME] [--checks InstanceStress]
        [--work-dir DIR] [--expected-gpus N] [--monitors kernel-log,nvidia-smi] [--kmsg]
        [--interval 1] [--fail-check NAME]

1. **On start**, the deep health checks (HyperPod's ``InstanceStress`` by default: cpu,
   memory, disk, shm, gpu; ``connectivity`` needs a job's nodes and is not run here).
   ``deep-health-check-status`` is ``InProgress`` while they run, and a Node that was
   ``Schedulable`` or unlabelled is ``Unschedulable`` (and tainted) meanwhile: no job pod
   lands on it before its checks pass. Then ``Passed`` (the agent's own
   ``Unschedulable`` becomes ``Schedulable`` again) or ``Failed`` (``Unschedulable``,
   tainted). A status the Node had before (set by hand, by the operator, by an earlier
   run's failure) is never lowered; it is cleared by hand (see ``kube/node_labels.py``).
   An earlier run that did not finish (``Unschedulable`` and ``InProgress``: the agent
   was killed during its checks) counts as this run's own.
2. **Then the monitors** (:func:`trainguard.health.continuous_watch`; by default only the
   hardware ones, the kernel log and nvidia-smi: free space and memory pressure on a Node
   that workloads share say more about the workloads than about the Node). Each finding
   labels the Node ``UnschedulablePendingReplacement`` or ``UnschedulablePendingReboot``
   (by its action) and taints it; the operator then moves the jobs' pods off it. The
   kernel log is ``$TRAINGUARD_KERNEL_LOG`` (a file: the rehearsal and test hook) and,
   with ``--kmsg`` only, ``/dev/kmsg`` (which needs a privileged container).

The Node is ``--node`` or ``$TRAINGUARD_NODE_NAME`` (the downward API's ``spec.nodeName``);
the label keys follow ``$TRAINGUARD_HYPERPOD_LABELS``. A write that fails (the API server
away) is tried again at each later look.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from types import FrameType
from typing import Final

from trainguard.health import (
    MONITOR_KINDS,
    CheckResult,
    Finding,
    HealthCheck,
    HealthWatch,
    SuiteConfig,
    continuous_watch,
    expand_check_names,
    on_start_checks,
    run_checks,
)
from trainguard.kube.api import KubeApi, KubeError
from trainguard.kube.config import NODE_NAME_ENV, Obj, OperatorConfig
from trainguard.kube.node_health import write_health
from trainguard.kube.node_labels import (
    SCHEDULABLE,
    UNSCHEDULABLE,
    HealthChange,
    HealthKeys,
)

__all__ = ["DEFAULT_MONITORS", "MONITORS", "HealthAgent", "main", "make_agent"]

logger = logging.getLogger("trainguard.health_agent")

MONITORS: Final = MONITOR_KINDS
DEFAULT_MONITORS: Final = ("kernel-log", "nvidia-smi")
START_READS: Final = 5
"""Tries to read the Node on start (a second apart, then more) before exiting."""
EXIT_USAGE: Final = 2


def start_change(current: str | None, deep: str | None = None) -> HealthChange:
    """While the checks run: InProgress, and Unschedulable on a Node that was healthy (or
    held by an earlier run of the agent that did not finish: Unschedulable, InProgress)."""
    held = current in (None, SCHEDULABLE) or (current == UNSCHEDULABLE and deep == "InProgress")
    reason = "health agent: deep health checks running"
    return HealthChange(UNSCHEDULABLE if held else None, "InProgress", reason, clear=held)


def result_change(results: Sequence[CheckResult], held: bool) -> HealthChange:
    """After the checks: Failed and Unschedulable, or Passed (and Schedulable again when
    ``held``: the agent made it Unschedulable for the run)."""
    failed = [r for r in results if r.failed]
    if failed:
        what = "; ".join(f"{r.name}: {r.message}" for r in failed)
        return HealthChange(
            UNSCHEDULABLE, "Failed", f"health agent: deep health check failed: {what}"
        )
    passed = "health agent: deep health checks passed"
    return HealthChange(SCHEDULABLE if held else None, "Passed", passed, clear=held)


def finding_change(finding: Finding) -> HealthChange:
    reason = f"health agent: {finding.kind}: {finding.message}"
    return HealthChange(finding.node_health_status, reason=reason)


class HealthAgent:
    """One Node's checks and monitors, and its labels; see the module docstring."""

    def __init__(
        self,
        api: KubeApi,
        node: str,
        keys: HealthKeys,
        checks: Sequence[HealthCheck],
        watch: HealthWatch,
        fail: Collection[str] = (),
    ) -> None:
        self.api = api
        self.node = node
        self.keys = keys
        self.checks = list(checks)
        self.watch = watch
        self.fail = frozenset(fail)
        self.results: list[CheckResult] = []
        self._pending: list[HealthChange] = []  # writes to try again, in order

    def start(self) -> list[CheckResult]:
        """Run the on-start checks, labelling the Node before and after."""
        labels = ((self._read().get("metadata") or {}).get("labels")) or {}
        change = start_change(labels.get(self.keys.status), labels.get(self.keys.deep))
        held = change.clear
        self._write(change)
        self.results = run_checks(self.checks, fail=self.fail)
        for result in self.results:
            logger.info(
                "check %s %s in %.2f s: %s",
                result.name,
                result.outcome,
                result.seconds,
                result.message,
            )
        self._write(result_change(self.results, held))
        return self.results

    def look(self, now: float | None = None) -> list[Finding]:
        """One round of the monitors that are due; each finding labels the Node."""
        self._flush()
        findings = self.watch.poll(now)
        for finding in findings:
            logger.warning(
                "finding %s (asks for a %s): %s", finding.kind, finding.action, finding.message
            )
            self._write(finding_change(finding))
        return findings

    def run(self, stop: threading.Event, interval: float = 1.0) -> None:
        """:meth:`start`, then :meth:`look` every ``interval`` seconds until ``stop``."""
        try:
            self.start()
            while not stop.wait(interval):
                self.look()
        finally:
            self.watch.close()

    def _read(self) -> Obj:
        for attempt in range(START_READS):
            try:
                return self.api.get_node(self.node)
            except KubeError as exc:
                if attempt == START_READS - 1:
                    raise
                logger.warning("cannot read node %s: %s; trying again", self.node, exc)
                time.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    def _write(self, change: HealthChange) -> None:
        self._pending.append(change)
        self._flush()

    def _flush(self) -> None:
        while self._pending:
            change = self._pending[0]
            try:
                if write_health(self.api, self.node, self.keys, change):
                    logger.info(
                        "node %s: %s %s, %s %s (%s)",
                        self.node,
                        self.keys.status,
                        change.status,
                        self.keys.deep,
                        change.deep,
                        change.reason,
                    )
            except KubeError as exc:
                logger.warning("cannot label node %s (trying again): %s", self.node, exc)
                return
            self._pending.pop(0)


def make_agent(
    api: KubeApi,
    node: str,
    keys: HealthKeys,
    *,
    checks: Sequence[str] = ("InstanceStress",),
    work_dir: str,
    expected_gpus: int | None = None,
    monitors: Collection[str] = DEFAULT_MONITORS,
    kmsg: bool = False,
    fail: Collection[str] = (),
    env: Mapping[str, str] | None = None,
) -> HealthAgent:
    """An agent for Node ``node``; ``ValueError`` names a bad check or monitor."""
    names = expand_check_names(checks)
    if "connectivity" in names:
        raise ValueError("connectivity: needs a job's nodes; the health agent does not run it")
    built = on_start_checks(SuiteConfig(checks=names, expected_gpus=expected_gpus), work_dir)
    missing = sorted(set(fail) - {c.name for c in built})
    if missing:
        raise ValueError(f"--fail-check {missing[0]}: not among the checks ({', '.join(names)})")
    os.makedirs(work_dir, exist_ok=True)
    watch = continuous_watch(
        work_dir, expected_gpus=expected_gpus, env=env, only=monitors, kmsg=kmsg
    )
    return HealthAgent(api, node, keys, built, watch, fail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainguard.kube.health_agent",
        description="Check and watch this Kubernetes Node's health; label and taint it.",
    )
    parser.add_argument(
        "--node",
        default=os.environ.get(NODE_NAME_ENV),
        help=f"the Node's name (default ${NODE_NAME_ENV})",
    )
    parser.add_argument(
        "--checks",
        default="InstanceStress",
        help="on-start checks, comma-separated: names or HyperPod's aliases (default "
        "InstanceStress: cpu, memory, disk, shm, gpu)",
    )
    parser.add_argument(
        "--work-dir", default="/tmp/trainguard-health", help="where the disk check writes"
    )
    parser.add_argument("--expected-gpus", type=int, help="GPUs this Node should have")
    parser.add_argument(
        "--monitors",
        default=",".join(DEFAULT_MONITORS),
        help=f"continuous monitors, comma-separated ({', '.join(MONITORS)})",
    )
    parser.add_argument("--kmsg", action="store_true", help="also read /dev/kmsg (needs rights)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between looks")
    parser.add_argument(
        "--fail-check",
        action="append",
        default=[],
        metavar="NAME",
        help="fail this check without running it (a rehearsal; repeatable)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if not args.node:
        parser.error(f"no Node: give --node or set ${NODE_NAME_ENV}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = OperatorConfig.from_env()
        api = KubeApi.connect()
        agent = make_agent(
            api,
            args.node,
            HealthKeys.of(settings),
            checks=[c.strip() for c in args.checks.split(",") if c.strip()],
            work_dir=args.work_dir,
            expected_gpus=args.expected_gpus,
            monitors=[m.strip() for m in args.monitors.split(",") if m.strip()],
            kmsg=args.kmsg,
            fail=args.fail_check,
        )
    except (ValueError, KubeError) as exc:
        print(f"trainguard health agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = threading.Event()

    def stopping(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    sources = [m.name for m in agent.watch.monitors]
    logger.info(
        "node %s: checks %s; monitors %s",
        args.node,
        ", ".join(c.name for c in agent.checks),
        ", ".join(sources) or "none",
    )
    try:
        agent.run(stop, args.interval)
    except KubeError as exc:
        logger.error("node %s: %s", args.node, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
