"""The operator: kopf handlers that run one :class:`KubeJob` per TrainingJob.

    python -m trainguard.kube.operator (--all-namespaces | --namespace NS ...)
        [--liveness-port 8080]

Settings come from ``TRAINGUARD_*`` variables (:class:`OperatorConfig`). Replicas of the
operator elect a leader on a Lease (:mod:`trainguard.kube.leader`); only the leader
runs kopf. ``--liveness-port`` serves ``/healthz`` and ``/readyz`` (ready: leading).

Each job has a daemon whose worker thread runs the job's control loop
(:func:`~trainguard.platform.drive.drive`); the agents of every job push their news to
one report inbox the operator serves. Deleting the job stops its workers and removes its
pods before the finalizer is released. When the operator exits (or dies), the pods keep
running; the next leader adopts each unfinished job as it runs, or restarts it from its
newest checkpoint when its pods are gone (:mod:`trainguard.kube.adopt`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import kopf

from trainguard.kube.api import KubeApi, KubeError
from trainguard.kube.config import (
    FINALIZER,
    GROUP,
    LEASE_NAME,
    PLURAL,
    VERSION,
    OperatorConfig,
)
from trainguard.kube.leader import LeaderElector, LeaseTimings
from trainguard.kube.pods import job_selector, network_policy_name, secret_name, service_name
from trainguard.kube.probes import serve_probes
from trainguard.kube.runner import KubeJob
from trainguard.kube.status import parse_time, rfc3339
from trainguard.observe.metrics import Metrics, serve
from trainguard.platform.inbox import Inbox
from trainguard.platform.procs import tune_gc_for_a_controller
from trainguard.platform.views import TERMINAL_PHASES
from trainguard.spec import SpecError

logger = logging.getLogger("trainguard.operator")
# After a delete: at most this long to stop the workers before the pods are deleted anyway.
DELETE_STOP_SECONDS = 120.0
# Time a job's daemon gets to return once stopped (it lets go of its loop at once).
DAEMON_CANCEL_SECONDS = 30.0
# Time a loop gets to end once let go of (it may be in the middle of a turn).
DETACH_SECONDS = 20.0

_metrics = Metrics()
_state: dict[str, Any] = {}
_state_lock = threading.Lock()
# The running jobs, by (namespace, name).
_running: dict[tuple[str, str], KubeJob] = {}


def _api() -> KubeApi:
    api = _state.get("api")
    if api is None:
        api = _state["api"] = KubeApi.connect()
    assert isinstance(api, KubeApi)
    return api


def _settings() -> OperatorConfig:
    settings = _state.get("settings")
    if settings is None:
        settings = _state["settings"] = OperatorConfig.from_env()
    assert isinstance(settings, OperatorConfig)
    return settings


def _inbox() -> Inbox | None:
    """The one server every job's agents push to (None when it cannot listen: the
    operator then polls only)."""
    with _state_lock:
        if "inbox" not in _state:
            settings = _settings()
            url = settings.report_base_url(settings.namespace())
            try:
                _state["inbox"] = Inbox(settings.report_host, settings.report_port, url)
                logger.info("agents push their reports to %s", url)
            except OSError as exc:
                where = f"{settings.report_host}:{settings.report_port}"
                logger.error("cannot take agent reports on %s: %s; polling only", where, exc)
                _state["inbox"] = None
        inbox = _state["inbox"]
        assert inbox is None or isinstance(inbox, Inbox)
        return inbox


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # kopf's own events: handler failures only
    settings.watching.server_timeout = 60
    settings.execution.max_workers = 32
    # The CRD is installed beforehand and the namespaces are given: no cluster scanning,
    # so the operator needs no rights on CRDs or namespaces.
    settings.scanning.disabled = True


@kopf.on.cleanup()
def _cleanup(**_: Any) -> None:
    with _state_lock:
        inbox = _state.pop("inbox", None)
    if isinstance(inbox, Inbox):
        inbox.close()


@kopf.on.delete(GROUP, VERSION, PLURAL)
def _deleted(name: str, namespace: str | None, **_: Any) -> None:
    """Stop the job's workers (all ranks at once, gracefully), then delete what it owns."""
    api, namespace = _api(), namespace or "default"
    job = _running.pop((namespace, name), None)
    if job is not None:
        job.cancel("TrainingJob deleted")
        if not job.ended.wait(DELETE_STOP_SECONDS):
            logger.warning("%s/%s: workers not stopped in time; deleting the pods", namespace, name)
            job.detach()
            job.ended.wait(DETACH_SECONDS)
        job.finish(delete_all=True)
    for pod in api.list_pods(namespace, job_selector(name)):
        api.delete_pod(namespace, pod["metadata"]["name"])
    policy = network_policy_name(name) if _settings().network_policy else None  # else no rights
    api.delete_owned(namespace, service_name(name), secret_name(name), policy)
    _metrics.deleted.inc()
    if job is not None:
        job.record.observer.forget()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=DAEMON_CANCEL_SECONDS)
async def _run_job(
    body: kopf.Body, name: str, namespace: str | None, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Run the job until it ends, then clean up and expire it. When stopped: a deleted
    job is finished by :func:`_deleted`; on operator exit the loop ends and the pods keep
    running."""
    api, settings, namespace = _api(), _settings(), namespace or "default"
    stored = copy.deepcopy(dict(body))
    status = stored.get("status") or {}
    if status.get("phase") in TERMINAL_PHASES:
        await _expire(api, stored, parse_time(status.get("completionTime")), stopped)
        return
    try:
        inbox = await asyncio.to_thread(_inbox)
        job = await asyncio.to_thread(KubeJob, api, stored, settings, _metrics, inbox)
    except SpecError as exc:
        reason = str(exc)
        logger.error("%s/%s: %s", namespace, name, reason)
        await asyncio.to_thread(
            api.patch_job_status,
            namespace,
            name,
            {"phase": "Failed", "reason": reason, "completionTime": rfc3339(time.time())},
        )
        _metrics.failed.inc()
        return
    if stopped:
        return
    key = (namespace, name)
    _running[key] = job
    loop = asyncio.ensure_future(asyncio.to_thread(job.run))
    waiting = asyncio.ensure_future(_until(stopped))
    try:
        await asyncio.wait({loop, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if not loop.done():
        why = stopped.reason
        if why is not None and kopf.DaemonStoppingReason.RESOURCE_DELETED in why:
            return  # _deleted stops the workers and deletes the pods
        job.detach()
        try:
            await loop
        finally:
            _running.pop(key, None)
            await asyncio.to_thread(job.close)
        return
    try:
        await loop  # an error of the loop: kopf restarts the daemon (a fresh start)
    except BaseException:
        _running.pop(key, None)
        await asyncio.to_thread(job.close)
        raise
    if _running.pop(key, None) is None:
        return  # deleted meanwhile: _deleted finishes it
    await asyncio.to_thread(job.finish)
    await _expire(api, stored, time.time(), stopped)


async def _until(stopped: kopf.DaemonStopped) -> None:
    await stopped.wait()


async def _expire(
    api: KubeApi, body: Mapping[str, Any], finished_at: float | None, stopped: kopf.DaemonStopped
) -> None:
    """Delete the finished job after ``ttlSecondsAfterFinished`` (unset or -1: never)."""
    ttl = ((body.get("spec") or {}).get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    if ttl is None or ttl < 0:
        return
    wait = max(0.0, float(ttl) - (time.time() - (finished_at or time.time())))
    await stopped.wait(wait)
    if stopped:
        return
    meta = body.get("metadata") or {}
    try:
        await asyncio.to_thread(api.delete_job, meta["namespace"], meta["name"])
    except KubeError as exc:
        logger.warning("%s/%s: ttl delete failed: %s", meta["namespace"], meta["name"], exc)


def _elect(settings: OperatorConfig) -> LeaderElector:
    """Wait until this replica leads (a standby waits here), then keep the Lease; losing
    it ends the process at once: the new leader may already run the jobs."""
    lease = settings.lease_seconds
    timings = LeaseTimings(lease, renew_seconds=lease / 3, retry_seconds=max(0.2, lease / 7))
    identity = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    elector = LeaderElector(_api(), settings.namespace(), LEASE_NAME, identity, timings)
    elector.acquire()

    def lost(why: str) -> None:
        logger.error("no longer the leader (%s): exiting; the jobs' pods keep running", why)
        logging.shutdown()
        os._exit(1)

    elector.keep(lost)
    return elector


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainguard.kube.operator",
        description="The trainguard operator: runs TrainingJobs on this cluster.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    parser.add_argument(
        "--liveness-port", type=int, help="serve /healthz and /readyz (leading) on this port"
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    try:
        settings = _settings()
    except ValueError as exc:
        parser.error(str(exc))
    if settings.leader_election and not 1 <= settings.lease_seconds <= 3600:
        parser.error("TRAINGUARD_LEASE_SECONDS: must be between 1 and 3600")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    tune_gc_for_a_controller()  # the operator holds every job's agent statuses
    leading = threading.Event()
    if args.liveness_port is not None:
        serve_probes(args.liveness_port, leading.is_set)
    elector = _elect(settings) if settings.leader_election else None
    leading.set()
    if settings.metrics_port:
        serve(_metrics, settings.metrics_port, host="0.0.0.0")  # in-cluster Prometheus scrapes it
    try:
        kopf.run(standalone=True, clusterwide=args.all_namespaces, namespaces=args.namespace)
    finally:
        if elector is not None:
            elector.release()  # the standby takes over at once (the pods keep running)
    return 0


if __name__ == "__main__":
    sys.exit(main())
