"""An elastic job's capacity on Kubernetes, pure: how many of its pods the Nodes hold
(kube/capacity.py), what Kueue's Workload says (kube/kueue.py), and the platform
combining them with the replica count (kube/kube_platform.py). The emulator runs are
in test_kube_capacity_emulator.py."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any, cast

import pytest

from trainguard.control.contact import ContactRule
from trainguard.kube.api import KubeApi, NotFound
from trainguard.kube.capacity import UNBOUNDED, PodShape, capacity, pod_requests, staying
from trainguard.kube.config import OperatorConfig
from trainguard.kube.kube_platform import KubePlatform, Outside
from trainguard.kube.kueue import QUEUE_LABEL, KueueWorkload, admission, queue_name, workload
from trainguard.kube.node import PodNode
from trainguard.kube.node_health import NodeHealthLabels
from trainguard.kube.plan import kube_plan
from trainguard.kube.record import ClusterRecord
from trainguard.platform.book import ReportBook
from trainguard.platform.control_config import control_config
from trainguard.platform.transport import AgentTransport
from trainguard.spec import parse_job

Obj = dict[str, Any]
HEALTH = "sagemaker.amazonaws.com/node-health-status"
RESOURCES = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "2"}}
GPU_POD = {
    "containers": [{"name": "c", "image": "i", "command": ["train"], "resources": RESOURCES}]
}


def node(name: str, cpu: str = "16", gpus: str = "8", **extra: Any) -> Obj:
    labels = extra.pop("labels", {})
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": extra.pop("spec", {}),
        "status": {
            "allocatable": {"cpu": cpu, "memory": "64Gi", "nvidia.com/gpu": gpus, "pods": "110"},
            "conditions": extra.pop("conditions", [{"type": "Ready", "status": "True"}]),
        },
    }


def bound(name: str, host: str, phase: str = "Running", **requests: str) -> Obj:
    names = {"nvidia_gpu": "nvidia.com/gpu"}
    resources = {"requests": {names.get(k, k): v for k, v in requests.items()}}
    return {
        "metadata": {"name": name},
        "spec": {"nodeName": host, "containers": [{"name": "c", "resources": resources}]},
        "status": {"phase": phase},
    }


def test_a_pods_requests_sum_its_containers_take_limits_and_count_one_pod() -> None:
    assert pod_requests(GPU_POD) == {
        "cpu": Decimal(4), "memory": Decimal(8 << 30), "nvidia.com/gpu": Decimal(2), "pods": 1,
    }  # fmt: skip
    spec = {"containers": [{"name": "a", "resources": {"requests": {"cpu": "500m"}}},
                           {"name": "b", "resources": {"requests": {"cpu": "250m"}}}],
            "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "2"}}}]}  # fmt: skip
    assert pod_requests(spec)["cpu"] == Decimal(2)  # the init container's, the larger
    with pytest.raises(ValueError, match="container 'c' resources: not a quantity"):
        pod_requests({"containers": [{"name": "c", "resources": {"requests": {"cpu": "lots"}}}]})


def test_free_gpus_decide_how_many_pods_fit_less_what_other_pods_take() -> None:
    shape = PodShape.of(GPU_POD)
    nodes = [node("a"), node("b"), node("c", gpus="1")]
    others = [bound("x", "a", nvidia_gpu="4"), bound("done", "b", "Succeeded", nvidia_gpu="8")]
    # a: 8 - 4 GPUs = 2 pods; b: 4 (the ended pod holds nothing); c: 1 GPU, none.
    assert capacity(nodes, others, shape, {}, HEALTH).pods == 6
    # The job's own pods are copies of the shape, not load: the same figure.
    ours = [bound("p0", "a", nvidia_gpu="2"), bound("p1", "b", nvidia_gpu="2")]
    held = capacity(nodes, others + ours, shape, {"node-0": "p0", "node-1": "p1"}, HEALTH)
    assert held.pods == 6 and held.leaving == ()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"spec": {"unschedulable": True}}, "cordoned"),
        ({"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]},
         "not Ready (NodeStatusUnknown)"),
        ({"labels": {HEALTH: "UnschedulablePendingReplacement"}},
         f"labelled {HEALTH}=UnschedulablePendingReplacement"),
        ({"labels": {HEALTH: "Unschedulable"}}, f"labelled {HEALTH}=Unschedulable"),
        ({"spec": {"taints": [{"key": "k", "value": "v", "effect": "NoExecute"}]}},
         "tainted k=v:NoExecute"),
    ],
)  # fmt: skip
def test_a_node_going_away_holds_nothing_and_the_jobs_pod_there_is_leaving(
    change: Obj, why: str
) -> None:
    shape = PodShape.of(GPU_POD)
    nodes = [node("a", gpus="2"), node("b", gpus="2", **change)]
    ours = [bound("p0", "a"), bound("p1", "b")]
    held = capacity(nodes, ours, shape, {"node-0": "p0", "node-1": "p1"}, HEALTH)
    assert held.pods == 1
    assert held.leaving == ("node-1",) and held.why["node-1"] == f"its pod's Node b is {why}"
    assert held.pods_leaving == {"p1"}
    assert staying(nodes[1], HEALTH) == why


def test_a_node_that_is_gone_makes_its_pod_leave_and_a_healthy_label_is_fine() -> None:
    shape = PodShape.of(GPU_POD)
    nodes = [node("a", gpus="2", labels={HEALTH: "Schedulable"})]
    held = capacity(nodes, [bound("p0", "a"), bound("p1", "b")], shape,
                    {"node-0": "p0", "node-1": "p1"}, HEALTH)  # fmt: skip
    assert held.pods == 1 and held.leaving == ("node-1",) and "gone" in held.why["node-1"]


def test_selectors_affinity_and_noschedule_taints_close_a_node_to_new_pods_only() -> None:
    spec = {
        **GPU_POD,
        "nodeSelector": {"pool": "gpu"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": HEALTH, "operator": "NotIn", "values": ["Unschedulable"]},
                {"key": "gen", "operator": "Gt", "values": ["3"]}]}]}}},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }  # fmt: skip
    shape = PodShape.of(spec)
    gpu = {"pool": "gpu", "gen": "4"}
    taint = {"key": "maintenance", "effect": "NoSchedule"}
    nodes = [
        node("a", gpus="2", labels=gpu),
        node("b", gpus="2", labels={"pool": "cpu", "gen": "4"}),  # not selected
        node("c", gpus="2", labels={"pool": "gpu", "gen": "3"}),  # gen 3 is not > 3
        node("d", gpus="2", labels=gpu, spec={"taints": [taint]}),  # untolerated NoSchedule
        node("e", gpus="2", labels=gpu, spec={"taints": [{"key": "gpu", "effect": "NoSchedule"}]}),
    ]
    # Open: a and e. The job's pod on d stays (NoSchedule keeps new pods off only).
    held = capacity(nodes, [bound("p0", "d")], shape, {"node-0": "p0"}, HEALTH)
    assert held.pods == 3 and held.leaving == ()


def test_a_node_without_allocatable_resources_holds_any_number() -> None:
    bare = {"metadata": {"name": "emulated"}}
    assert capacity([bare], [], PodShape.of(GPU_POD), {}, HEALTH).pods == UNBOUNDED


# -- Kueue's Workload ---------------------------------------------------------------------


def job_body(queue: str | None = "team-a", replicas: int = 2) -> Obj:
    labels = {QUEUE_LABEL: queue} if queue else {}
    template = {"metadata": {"labels": {"app": "x"}, "name": "dropped"},
                "spec": {"priorityClassName": "high", **GPU_POD}}  # fmt: skip
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "job", "namespace": "ml", "uid": "u1", "labels": labels},
        "spec": {
            "replicaSpecs": [{"name": "workers", "replicas": replicas, "template": template}],
            "elasticPolicy": {"minReplicas": 1, "maxReplicas": 4},
        },
    }


def test_the_workload_queues_each_group_as_a_podset_owned_by_the_job() -> None:
    assert queue_name(job_body()) == "team-a" and queue_name(job_body(None)) is None
    made = workload(job_body(), "team-a")
    assert made["apiVersion"] == "kueue.x-k8s.io/v1beta1" and made["kind"] == "Workload"
    assert made["metadata"]["name"] == "trainingjob-job" and made["metadata"]["namespace"] == "ml"
    assert made["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert made["spec"]["queueName"] == "team-a"
    assert made["spec"]["priorityClassName"] == "high"
    (pod_set,) = made["spec"]["podSets"]
    assert pod_set["name"] == "workers" and pod_set["count"] == 2
    assert pod_set["template"]["metadata"] == {"labels": {"app": "x"}}  # only these allowed


def condition(kind: str, reason: str = "", message: str = "") -> Obj:
    return {"type": kind, "status": "True", "reason": reason, "message": message}


def test_admission_is_the_pods_assigned_and_an_eviction_says_why() -> None:
    made = workload(job_body(replicas=3), "team-a")
    assert admission(made) == admission({}) and not admission(made).admitted
    reserved = {"status": {"conditions": [condition("QuotaReserved")]}}
    assert admission({**made, **reserved}).pods == 0  # quota, but admission checks pending
    admitted = {"admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers"}]},
                "conditions": [condition("QuotaReserved"), condition("Admitted")]}  # fmt: skip
    assert admission({**made, "status": admitted}).pods == 3  # no count: the PodSet's
    admitted["admission"]["podSetAssignments"][0]["count"] = 2  # partial admission
    state = admission({**made, "status": admitted})
    assert state.pods == 2 and state.admitted
    admitted["conditions"].append(condition("Evicted", "Preempted", "to fit a higher one"))
    state = admission({**made, "status": admitted})
    assert state.evicted == "Preempted: to fit a higher one" and not state.admitted


class FakeKueue:
    """The custom-object calls of ``KubeApi`` on one Workload (or none served)."""

    def __init__(self, served: bool = True) -> None:
        self.served = served
        self.stored: Obj | None = None
        self.deleted = False

    def create_object(self, group: str, version: str, ns: str, plural: str, body: Obj) -> Obj:
        if not self.served:
            raise NotFound("404 the server could not find the requested resource", 404)
        self.stored = body
        return body

    def get_object(self, group: str, version: str, ns: str, plural: str, name: str) -> Obj:
        if self.stored is None:
            raise NotFound("404", 404)
        return self.stored

    def delete_object(self, group: str, version: str, ns: str, plural: str, name: str) -> None:
        self.deleted, self.stored = True, None


def test_a_workload_taken_away_after_admission_is_an_eviction() -> None:
    assert KueueWorkload.create(cast(KubeApi, FakeKueue(False)), job_body(), 1.0) is None
    assert KueueWorkload.create(cast(KubeApi, FakeKueue()), job_body(None), 1.0) is None
    api = FakeKueue()
    queued = KueueWorkload.create(cast(KubeApi, api), job_body(), 1.0)
    assert queued is not None and api.stored is not None
    api.stored = None  # deleted while queued: created again
    assert queued.read(0.0).pods == 0 and api.stored is not None
    api.stored = {**api.stored, "status": {
        "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers"}]},
        "conditions": [condition("Admitted")]}}  # fmt: skip
    assert queued.read(0.5).pods == 0  # read at most once per interval
    assert queued.read(1.0).admitted
    api.stored = {**api.stored, "status": {"conditions": [condition("QuotaReserved")]}}
    assert queued.read(2.0).evicted == "Kueue took its admission back"
    queued.delete()
    assert api.deleted


# -- the platform: capacity is the least of the replicas, the Nodes and Kueue -------------


class FakeCluster(FakeKueue):
    def __init__(self, nodes: list[Obj], pods: list[Obj]) -> None:
        super().__init__()
        self.nodes, self.pods = nodes, pods

    def get_job(self, namespace: str, name: str) -> Obj:
        return job_body(replicas=4)

    def list_pods(self, namespace: str, selector: Mapping[str, str]) -> list[Obj]:
        return self.pods

    def all_nodes(self) -> list[Obj]:
        return self.nodes

    def bound_pods(self) -> list[Obj]:
        return self.pods

    def list_nodes(self, label: str, values: list[str]) -> list[Obj]:
        return [n for n in self.nodes if n["metadata"]["labels"].get(label) in values]


def test_the_platform_reports_the_least_capacity_and_the_nodes_leaving() -> None:
    body = job_body(replicas=4)
    settings = OperatorConfig()
    job = parse_job(body, "ml/job")
    _, groups = control_config(kube_plan(job, "ml/job"), "job", durable=False)
    gpus = {"labels": {}, "gpus": "2"}
    cordoned = node("b", spec={"unschedulable": True}, **gpus)
    api = FakeCluster([node("a", **gpus), cordoned, node("c", **gpus)], [])
    book = ReportBook()
    kube = KubePlatform(
        cast(KubeApi, api), job, body, settings, groups,
        AgentTransport(book, "t", poll_interval=1.0),
        cast(ClusterRecord, None), Outside(book), poll_interval=1.0, contact_rule=ContactRule(3),
        node_health=NodeHealthLabels(cast(KubeApi, api), settings, "ml/job"),
        kueue=KueueWorkload.create(cast(KubeApi, api), body, 1.0),
    )  # fmt: skip
    for node_id, pod, host in (("workers-0", "p0", "a"), ("workers-1", "p1", "b")):
        kube.nodes[node_id] = PodNode(node_id, pod)
        book.reset(node_id, pod)
        api.pods.append({**bound(pod, host, nvidia_gpu="2"), "metadata": {"name": pod}})
    assert api.stored is not None
    api.stored["status"] = {"conditions": [condition("Admitted")], "admission": {
        "clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 3}]}}  # fmt: skip
    seen = kube.observe(10.0)
    # Replicas 4, Kueue 3, the Nodes 2 (a and c; b is cordoned): 2, and node 1 leaves.
    assert seen.capacity == 2 and tuple(seen.preempted) == ("workers-1",)
    assert seen.cancel is None
    api.stored["status"]["conditions"].append(condition("Evicted", "Preempted", "by team-b"))
    seen = kube.observe(20.0)
    assert seen.cancel is not None and "Preempted: by team-b" in seen.cancel.reason
