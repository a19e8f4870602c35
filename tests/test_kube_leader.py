"""Leader election of the operator's replicas (kube/leader.py) on the emulated API server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import wait_for
from kube_harness import ApiServer
from trainguard.kube.api import KubeApi
from trainguard.kube.leader import LeaderElector, LeaseTimings

NAMESPACE, LEASE = "trainguard-system", "trainguard-operator"
QUICK = LeaseTimings(lease_seconds=1.5, renew_seconds=0.3, retry_seconds=0.1)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApi]:
    server = ApiServer()
    try:
        path = server.write_kubeconfig(tmp_path_factory.mktemp("leader") / "kubeconfig")
        yield KubeApi.connect(str(path))
    finally:
        server.stop()


def elector(api: KubeApi, name: str, lease: str, timings: LeaseTimings = QUICK) -> LeaderElector:
    return LeaderElector(api, NAMESPACE, lease, name, timings)


def test_one_leader_while_it_renews_then_the_standby_takes_over(api: KubeApi) -> None:
    first, second = elector(api, "a", "renewing"), elector(api, "b", "renewing")
    assert first.acquire()
    lost: list[str] = []
    first.keep(lost.append)
    # Three lease durations of a standby trying: the renewing leader keeps the Lease.
    deadline = time.monotonic() + 3 * QUICK.lease_seconds
    while time.monotonic() < deadline:
        assert second.try_once() in ("a", None)
        time.sleep(QUICK.retry_seconds)
    assert api.get_lease(NAMESPACE, "renewing")["spec"]["holderIdentity"] == "a"
    assert not lost

    first._stop.set()  # the leader dies: it renews no more
    started = time.monotonic()
    assert second.acquire()
    waited = time.monotonic() - started
    assert waited >= QUICK.lease_seconds * 0.5  # not before the lease could have run out
    spec = api.get_lease(NAMESPACE, "renewing")["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1


def test_a_released_lease_is_taken_at_once_and_a_leader_that_lost_it_is_told(
    api: KubeApi,
) -> None:
    first, second = elector(api, "a", "released"), elector(api, "b", "released")
    assert first.acquire()
    first.release()
    started = time.monotonic()
    assert second.acquire()
    assert time.monotonic() - started < QUICK.lease_seconds

    # "b" leads; "c" sees it renew. If "b"'s Lease is taken anyway (an expired view
    # elsewhere), b's renewal finds another holder and reports the loss.
    lost: list[str] = []
    second.keep(lost.append)
    third = elector(api, "c", "released")
    lease = api.get_lease(NAMESPACE, "released")
    lease["spec"]["holderIdentity"] = "c"
    api.update_lease(NAMESPACE, "released", lease)
    wait_for(lambda: bool(lost), 10)
    assert "held by c" in lost[0]
    assert third.try_once() == "c"


def test_acquire_returns_false_when_stopped(api: KubeApi) -> None:
    holder = elector(api, "a", "stopped")
    assert holder.acquire()
    holder.keep(lambda why: None)
    stop = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(
        target=lambda: result.append(elector(api, "b", "stopped").acquire(stop))
    )
    waiter.start()
    time.sleep(0.5)
    stop.set()
    waiter.join(10)
    assert result == [False]
    holder.release()


def test_timings_are_checked() -> None:
    with pytest.raises(ValueError):
        LeaseTimings(lease_seconds=2, renew_seconds=3)


def test_probes_say_alive_always_and_ready_only_while_leading() -> None:
    import urllib.error
    import urllib.request

    from kube_harness import free_port
    from trainguard.kube.probes import serve_probes

    leading = threading.Event()
    port = free_port()
    server = serve_probes(port, leading.is_set, host="127.0.0.1")

    def code(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert (code("/healthz"), code("/readyz")) == (200, 503)
        leading.set()
        assert (code("/healthz"), code("/readyz")) == (200, 200)
        assert code("/other") == 404
    finally:
        server.close()


def test_the_deployment_runs_a_leader_and_a_standby_only_the_leader_ready() -> None:
    from trainguard.kube.config import OperatorConfig
    from trainguard.kube.manifests import operator_objects

    def deployment(settings: OperatorConfig) -> tuple[dict[str, Any], list[str]]:
        objects = operator_objects(settings=settings)
        names = [o["metadata"]["name"] for o in objects if o["kind"] == "Role"]
        return next(o for o in objects if o["kind"] == "Deployment"), names

    elected, roles = deployment(OperatorConfig())
    assert elected["spec"]["replicas"] == 2 and "trainguard-operator-leader" in roles
    container = elected["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"name": "TRAINGUARD_LEASE_SECONDS", "value": "15.0"} in container["env"]
    single, roles = deployment(OperatorConfig(leader_election=False))
    assert single["spec"]["replicas"] == 1 and "trainguard-operator-leader" not in roles
