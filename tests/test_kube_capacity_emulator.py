"""An elastic job follows the cluster's capacity on the emulator: a Node cordoned, or
labelled unhealthy, takes its pod's node away ahead (a scale-down), and the Node back
brings the job back up; a job queued in Kueue (its resources declared on the emulator,
the test playing Kueue's controller) starts once its Workload is admitted and stops when
Kueue preempts it (kube/capacity.py, kube/kueue.py).

Each Node allocates one CPU and the job's pod requests one: three Nodes hold three pods.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO, wait_for
from kube_cluster import JOB_TIMEOUT, Cluster, fake, job_manifest, running_cluster
from test_kube_elastic import worlds
from trainguard.kube.api import NotFound
from trainguard.kube.config import OperatorConfig
from trainguard.kube.kueue import KUEUE_GROUP, KUEUE_VERSION, QUEUE_LABEL, WORKLOADS

Obj = dict[str, Any]
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    nodes: dict[str, dict[str, str]] = {name: {} for name in NODES}
    with running_cluster(tmp_path_factory.mktemp("capacity"), nodes) as cluster:
        for name in NODES:
            cluster.api.patch_node(name, {"status": {"allocatable": {"cpu": "1", "pods": "10"}}})
        yield cluster


def groups(out: Path, replicas: int) -> list[Obj]:
    container = {"name": "trainer", "image": "trainguard:test", "workingDir": str(REPO),
                 "command": fake(out, "--sleep", "300"),
                 "resources": {"requests": {"cpu": "1"}}}  # fmt: skip
    return [
        {"name": "pods", "replicas": replicas, "template": {"spec": {"containers": [container]}}}
    ]


def hosts(cluster: Cluster, name: str) -> dict[str, str]:
    """Each node id's Kubernetes Node."""
    return {n["nodeId"]: n["hostNode"] for n in cluster.status(name).get("nodes") or []}


def running_at(cluster: Cluster, name: str, out: Path, size: int) -> bool:
    status = cluster.status(name)
    attempt = status.get("attempt", 0)
    return status.get("phase") == "Running" and worlds(out, attempt) == [str(size)] * size


def scalings(cluster: Cluster, name: str) -> list[str]:
    events = cluster.describe(name)["events"]
    return [e["message"] for e in events if e["reason"] == "ElasticScaling"]


@pytest.mark.long
@pytest.mark.timeout(900)  # four scalings, each a stop and a start of every pod
def test_a_cordoned_or_unhealthy_node_scales_the_job_down_and_its_return_back_up(
    cluster: Cluster,
) -> None:
    name, out = "capacity", cluster.root / "out-capacity"
    cluster.submit(
        name,
        [],
        nprocPerNode=1,
        replicaSpecs=groups(out, 3),
        elasticPolicy={"minReplicas": 1, "maxReplicas": 3, "scalingTimeoutInSeconds": 2,
                       "gracefulShutdownTimeoutInSeconds": 1},
        # No memory-pressure monitor: a loaded test machine is not a fault of this job.
        trainguard={"pollIntervalSeconds": 0.3, "stopGracePeriodSeconds": 1,
                    "healthChecks": {"continuous": []}},
    )  # fmt: skip
    wait_for(lambda: running_at(cluster, name, out, 3), JOB_TIMEOUT)
    on_c = next(n for n, host in hosts(cluster, name).items() if host == "node-c")

    # kubectl cordon node-c: its pod keeps running, but the Node is going away.
    cluster.api.patch_node("node-c", {"spec": {"unschedulable": True}})
    wait_for(lambda: running_at(cluster, name, out, 2), JOB_TIMEOUT)
    assert "node-c" not in hosts(cluster, name).values()
    said = scalings(cluster, name)
    assert f"scale down 3 -> 2 nodes: {on_c} preempted" in said[-1], said

    # kubectl uncordon node-c: room for a third pod again.
    cluster.api.patch_node("node-c", {"spec": {"unschedulable": False}})
    wait_for(lambda: running_at(cluster, name, out, 3), JOB_TIMEOUT)
    assert sorted(hosts(cluster, name).values()) == list(NODES)
    assert "scale up 2 -> 3 nodes" in scalings(cluster, name)[-1]

    # node-b labelled Unschedulable (deep health checks, say), then Schedulable again.
    label = OperatorConfig().health_label
    on_b = next(n for n, host in hosts(cluster, name).items() if host == "node-b")
    cluster.api.patch_node("node-b", {"metadata": {"labels": {label: "Unschedulable"}}})
    wait_for(lambda: running_at(cluster, name, out, 2), JOB_TIMEOUT)
    assert "node-b" not in hosts(cluster, name).values()
    assert f"scale down 3 -> 2 nodes: {on_b} preempted" in scalings(cluster, name)[-1]
    cluster.api.patch_node("node-b", {"metadata": {"labels": {label: "Schedulable"}}})
    wait_for(lambda: running_at(cluster, name, out, 3), JOB_TIMEOUT)
    status = cluster.status(name)
    assert status["restartCount"] == 0 and status.get("faults", []) == [], status

    cluster.api.delete_job("default", name)  # the operator stops it meanwhile


def workload_status(cluster: Cluster, name: str, status: Obj) -> None:
    """Kueue's controller writing the Workload's status."""
    cluster.api.custom.patch_namespaced_custom_object_status(
        KUEUE_GROUP, KUEUE_VERSION, "default", WORKLOADS, name, {"status": status}
    )


def condition(kind: str, reason: str, message: str = "") -> Obj:
    return {"type": kind, "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip


@pytest.mark.long
def test_a_queued_job_starts_once_kueue_admits_it_and_stops_when_preempted(
    cluster: Cluster,
) -> None:
    custom = cluster.api.custom
    queue = {"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ClusterQueue",
             "metadata": {"name": "cluster-queue"}, "spec": {"namespaceSelector": {}}}  # fmt: skip
    custom.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", queue)
    local = {"apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "LocalQueue",
             "metadata": {"name": "team-a", "namespace": "default"},
             "spec": {"clusterQueue": "cluster-queue"}}  # fmt: skip
    custom.create_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, "default", "localqueues",
                                           local)  # fmt: skip

    name, out = "queued", cluster.root / "out-queued"
    manifest = job_manifest(name, [], nprocPerNode=1, replicaSpecs=groups(out, 2))
    manifest["metadata"]["labels"] = {QUEUE_LABEL: "team-a"}
    path = cluster.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert cluster.tg("submit", "-f", str(path)).returncode == 0

    workload = f"trainingjob-{name}"

    def read() -> Obj:
        return dict(cluster.api.get_object(KUEUE_GROUP, KUEUE_VERSION, "default", WORKLOADS,
                                           workload))  # fmt: skip

    def exists() -> bool:
        try:
            read()
        except NotFound:
            return False
        return True

    wait_for(exists, JOB_TIMEOUT)
    spec = read()["spec"]
    assert spec["queueName"] == "team-a" and spec["podSets"][0]["count"] == 2
    # Not admitted: no pod of the job is created.
    with pytest.raises(AssertionError):
        wait_for(lambda: any(p.startswith(f"{name}-") for p in cluster.kubelet.started), 3.0)

    admitted = {"admission": {"clusterQueue": "cluster-queue",
                              "podSetAssignments": [{"name": "pods", "count": 2}]},
                "conditions": [condition("QuotaReserved", "QuotaReserved"),
                               condition("Admitted", "Admitted")]}  # fmt: skip
    workload_status(cluster, workload, admitted)
    wait_for(lambda: running_at(cluster, name, out, 2), JOB_TIMEOUT)

    preempted = condition("Evicted", "Preempted", "Preempted to accommodate a higher priority")
    evicted = {**admitted, "conditions": [*admitted["conditions"], preempted]}
    workload_status(cluster, workload, evicted)
    status = cluster.wait_phase(name, "Stopped", "Failed", "Succeeded")
    assert status["phase"] == "Stopped", status
    assert "Preempted to accommodate a higher priority" in str(status.get("conditions")), status
    wait_for(lambda: not exists(), JOB_TIMEOUT)  # deleted: its quota is released
