"""The front door: run a job on a :mod:`target <trainguard.platform.target>` (this
machine, the controller's host of a job across hosts, a Slurm batch script, a resumed
job) and map its end to ``trainguard``'s exit code, in one place.

    launch(JobToRun(plan, store, source), Hosts(controller))

``trainguard run`` (:mod:`trainguard.platform.run`), its hosts and Slurm forms
(:mod:`trainguard.hosts.run`, :mod:`trainguard.slurm.run`) and ``trainguard resume``
(:mod:`trainguard.platform.resume_command`) only work out the target, then call it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.http_server import ListenError
from trainguard.platform.inject import Injection
from trainguard.platform.local import (
    EXIT_INTERRUPTED,
    LocalRunner,
    MetricsOptions,
    MetricsPortError,
)
from trainguard.platform.store import Store
from trainguard.platform.target import Hosts, Slurm, Target
from trainguard.spec.plan import JobPlan

__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "JobToRun", "launch", "usage"]

EXIT_USAGE = 2


@dataclass(frozen=True)
class JobToRun:
    """What every target runs: the plan, where it is recorded, and the run's options."""

    plan: JobPlan
    store: Store
    source: str
    injections: Sequence[Injection] = ()
    live: bool = False
    metrics: MetricsOptions | None = None


def launch(job: JobToRun, target: Target) -> int:
    """Run ``job`` on ``target`` until it ends; the exit code: 0 (succeeded), 1
    (failed, stopped), 2 (a usage error: an ``--inject`` target outside the job, a port
    that cannot be bound), 130 (Ctrl-C or SIGTERM)."""
    try:
        runner = LocalRunner(
            job.plan, job.store, job.source, job.injections, live=job.live,
            metrics=job.metrics, target=target,
        )  # fmt: skip
    except ValueError as exc:  # an --inject target outside the job
        return usage(str(exc))
    try:
        result = runner.run()
    except MetricsPortError as exc:
        return usage(str(exc))
    except ListenError as exc:  # the endpoint's port is taken; not a fault mid-job
        assert isinstance(target, Hosts | Slurm)
        endpoint = target.controller.endpoint
        return usage(f"--rdzv-endpoint {endpoint}: cannot listen: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("[trainguard] interrupted; every worker was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if runner.interrupted else result.exit_code


def usage(message: str) -> int:
    """Say a usage error; its exit code."""
    for line in message.splitlines():
        print(f"trainguard: {line}", file=sys.stderr)
    return EXIT_USAGE
