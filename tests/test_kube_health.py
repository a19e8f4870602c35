"""Node health on Kubernetes, the operator's side: label keys, the job pods' affinity, the
rules of a Node's labels and taint, labels written on NodeHealth events, and a Node
labelled by hand moving a job's pod off it (a Replace), against kmock's API server."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from kube_harness import ApiServer
from trainguard.control.events import Event
from trainguard.kube.api import KubeApi
from trainguard.kube.config import OperatorConfig
from trainguard.kube.node import PodNode
from trainguard.kube.node_health import NodeHealthLabels
from trainguard.kube.node_labels import (
    HealthChange,
    HealthKeys,
    NodeFault,
    health_patch,
    label_value,
)
from trainguard.kube.plan import kube_plan
from trainguard.kube.pods import node_pod
from trainguard.kube.runner import KubeJob
from trainguard.observe.metrics import Metrics
from trainguard.platform.base import Replace
from trainguard.platform.drive import execute
from trainguard.spec import parse_job

Obj = dict[str, Any]
STATUS = "trainguard.dev/node-health-status"
DEEP = "trainguard.dev/deep-health-check-status"
TAINT = "trainguard.dev/unhealthy"
REASON = "trainguard.dev/node-health-reason"
FAULT_TYPE = "trainguard.dev/fault-type"
FAULT_REASON = "trainguard.dev/fault-reason"
KEYS = HealthKeys(STATUS, DEEP)
FAULT_KEYS = HealthKeys(STATUS, DEEP, FAULT_TYPE, FAULT_REASON)
_names = itertools.count()


def test_label_keys_are_trainguards_unless_hyperpods_are_asked_for() -> None:
    settings = OperatorConfig()
    assert (settings.health_label, settings.deep_health_label) == (STATUS, DEEP)
    hyperpod = OperatorConfig.from_env({"TRAINGUARD_HYPERPOD_LABELS": "true"})
    assert hyperpod.health_label == "sagemaker.amazonaws.com/node-health-status"
    assert hyperpod.deep_health_label == "sagemaker.amazonaws.com/deep-health-check-status"
    assert hyperpod.fault_type_label == "sagemaker.amazonaws.com/fault-type"
    assert hyperpod.fault_reason_label == "sagemaker.amazonaws.com/fault-reason"
    assert (settings.fault_type_label, settings.fault_reason_label) == (FAULT_TYPE, FAULT_REASON)
    assert OperatorConfig.from_env(hyperpod.to_env()) == hyperpod
    assert (
        settings.node_labels
        and not OperatorConfig.from_env({"TRAINGUARD_NODE_LABELS": "false"}).node_labels
    )


def _gpt_body(**pod: Any) -> Obj:
    body: Obj = yaml.safe_load((REPO / "examples" / "gpt" / "job.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0c3e9ad5-4bd3-4c1e-9a70-2b6c0d0d6b1e")
    body["spec"]["replicaSpecs"][0]["template"]["spec"].update(pod)
    return body


@pytest.mark.parametrize("hyperpod", [False, True])
def test_job_pods_require_a_healthy_node_and_prefer_a_passed_deep_check(hyperpod: bool) -> None:
    own = {"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}
    tolerations = [
        {"key": TAINT, "operator": "Exists"},  # never: a job pod stays off unhealthy Nodes
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    body = _gpt_body(
        affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [own]}},
        tolerations=tolerations,
    )
    job = parse_job(body, "ml/gpt")
    settings = OperatorConfig(hyperpod_labels=hyperpod)
    pod = node_pod(job, body, 0, kube_plan(job, "ml/gpt").groups[0], "node-1", "p", 0, settings)
    kubernetes_validate.validate(pod, "1.31", strict=True)
    prefix = "sagemaker.amazonaws.com" if hyperpod else "trainguard.dev"
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"] for t in terms] == [
        [{"key": f"{prefix}/node-health-status", "operator": "DoesNotExist"}],
        [{"key": f"{prefix}/node-health-status", "operator": "In", "values": ["Schedulable"]}],
    ]
    passed = {"key": f"{prefix}/deep-health-check-status", "operator": "In", "values": ["Passed"]}
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"] == [
        own,
        {"weight": 100, "preference": {"matchExpressions": [passed]}},
    ]
    assert pod["spec"]["tolerations"] == tolerations[1:]


def _node(labels: dict[str, str] | None = None, taints: list[Obj] | None = None) -> Obj:
    return {
        "metadata": {"name": "n", "labels": labels or {}, "resourceVersion": "7"},
        "spec": {"taints": taints or []},
    }


def test_a_status_is_never_lowered_and_the_taint_follows_it() -> None:
    gpu = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    replace = HealthChange("UnschedulablePendingReplacement", None, "XID 79")
    patch = health_patch(_node(taints=[gpu]), KEYS, replace)
    assert patch == {
        "metadata": {
            "labels": {STATUS: "UnschedulablePendingReplacement"},
            "annotations": {REASON: "XID 79"},
            "resourceVersion": "7",  # a Node changed meanwhile is a conflict
        },
        "spec": {
            "taints": [
                gpu,
                {"key": TAINT, "value": "UnschedulablePendingReplacement", "effect": "NoSchedule"},
            ]
        },
    }
    pending = _node(
        {STATUS: "UnschedulablePendingReplacement"},
        [{"key": TAINT, "value": "UnschedulablePendingReplacement", "effect": "NoSchedule"}],
    )
    # Lower statuses leave it as it is; only the deep status is written.
    assert health_patch(pending, KEYS, HealthChange("Unschedulable", "Failed")) == {
        "metadata": {"labels": {DEEP: "Failed"}, "resourceVersion": "7"}
    }
    assert health_patch(pending, KEYS, HealthChange("Schedulable", "Passed", clear=True)) == {
        "metadata": {"labels": {DEEP: "Passed"}, "resourceVersion": "7"}
    }
    assert health_patch(pending, KEYS, HealthChange("UnschedulablePendingReboot")) is None
    # The health agent clears the Unschedulable it set while its checks ran.
    held = _node(
        {STATUS: "Unschedulable", DEEP: "InProgress"},
        [gpu, {"key": TAINT, "value": "Unschedulable", "effect": "NoSchedule"}],
    )
    cleared = health_patch(held, KEYS, HealthChange("Schedulable", "Passed", "ok", clear=True))
    assert cleared is not None
    assert cleared["metadata"]["labels"] == {STATUS: "Schedulable", DEEP: "Passed"}
    assert cleared["spec"] == {"taints": [gpu]}
    assert health_patch(held, KEYS, HealthChange("Schedulable")) is None  # not without clear
    # A value typed by hand counts as Unschedulable.
    odd = _node({STATUS: "Broken"})
    assert health_patch(odd, KEYS, HealthChange("Unschedulable")) == {
        "spec": {"taints": [{"key": TAINT, "value": "Broken", "effect": "NoSchedule"}]},
        "metadata": {"resourceVersion": "7"},
    }
    reboot = health_patch(odd, KEYS, HealthChange("UnschedulablePendingReboot"))
    assert reboot is not None
    assert reboot["metadata"]["labels"] == {STATUS: "UnschedulablePendingReboot"}


def test_fault_type_and_reason_are_written_with_the_status_and_go_when_it_is_cleared() -> None:
    xid = NodeFault("NodeUnhealthy", "XID")
    replace = HealthChange("UnschedulablePendingReplacement", None, "XID 79", fault=xid)
    patch = health_patch(_node(), FAULT_KEYS, replace)
    assert patch is not None
    assert patch["metadata"]["labels"] == {
        STATUS: "UnschedulablePendingReplacement",
        FAULT_TYPE: "NodeUnhealthy",
        FAULT_REASON: "XID",
    }
    # Not lowered: the fault that set the status stays with it.
    pending = _node(patch["metadata"]["labels"], patch["spec"]["taints"])
    cpu = NodeFault("HealthCheckFailed", "cpu")
    assert health_patch(pending, FAULT_KEYS, HealthChange("Unschedulable", fault=cpu)) is None
    # The same status again, for another fault: the newer fault is written.
    again = HealthChange("UnschedulablePendingReplacement", fault=NodeFault("NodeUnhealthy", "Ecc"))
    assert health_patch(pending, FAULT_KEYS, again) == {
        "metadata": {"labels": {FAULT_REASON: "Ecc"}, "resourceVersion": "7"}
    }
    # The health agent clears its own Unschedulable: the fault labels are removed.
    held = _node({STATUS: "Unschedulable", FAULT_TYPE: "HealthCheckFailed", FAULT_REASON: "cpu"})
    cleared = health_patch(held, FAULT_KEYS, HealthChange("Schedulable", "Passed", clear=True))
    assert cleared is not None
    assert cleared["metadata"]["labels"] == {
        STATUS: "Schedulable",
        DEEP: "Passed",
        FAULT_TYPE: None,  # a merge patch's null removes the label
        FAULT_REASON: None,
    }
    # Keys without the fault's: nothing about it is written.
    assert FAULT_TYPE not in (health_patch(_node(), KEYS, replace) or {})["metadata"]["labels"]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("XID", "XID"),
        ("gpu check", "gpu-check"),
        ("-=[NVRM: Xid 79]=-", "NVRM-Xid-79"),
        ("x" * 70 + "!", "x" * 63),
        ("a" * 62 + " b", "a" * 62),  # cut at 63, then no '-' left at the end
        ("::", "Unknown"),
    ],
)
def test_label_values_are_valid_kubernetes_label_values(text: str, value: str) -> None:
    assert label_value(text) == value


# -- against the emulated API server ------------------------------------------------------


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApi]:
    server = ApiServer()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")
        yield KubeApi.connect(str(kubeconfig))
    finally:
        server.stop()


def new_node(api: KubeApi, labels: dict[str, str] | None = None) -> str:
    name = f"host-{next(_names)}"
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
    api.core.create_node(body, _preload_content=False)
    return name


def pod_on(host: str | None, name: str = "pod-x") -> PodNode:
    pod = PodNode("node-0", name)
    pod.observe({"metadata": {"name": name}, "spec": {"nodeName": host}, "status": {}})
    return pod


def health_event(status: str, deep: str | None = None, node: str = "node-0") -> Event:
    data = {"status": status, "deep": deep, "reason": "its cpu check failed: too slow"}
    return Event(time.time(), "NodeHealth", f"{node} is now {status}", 0, node, data=data)


def test_a_node_health_event_labels_and_taints_the_node_its_pod_ran_on(api: KubeApi) -> None:
    host = new_node(api)
    labels = NodeHealthLabels(api, OperatorConfig(), "ml/gpt")
    labels.record(health_event("Unschedulable", "Failed"), pod_on(host))
    node = api.get_node(host)
    assert node["metadata"]["labels"][STATUS] == "Unschedulable"
    assert node["metadata"]["labels"][DEEP] == "Failed"
    assert (
        node["metadata"]["annotations"][REASON] == "ml/gpt node-0: its cpu check failed: too slow"
    )
    assert node["spec"]["taints"] == [
        {"key": TAINT, "value": "Unschedulable", "effect": "NoSchedule"}
    ]
    # Schedulable says nothing to label; a worse status replaces the label and taint.
    labels.record(health_event("Schedulable", "Passed"), pod_on(host))
    assert api.get_node(host)["metadata"]["labels"][DEEP] == "Failed"
    labels.record(health_event("UnschedulablePendingReboot"), pod_on(host))
    node = api.get_node(host)
    assert node["metadata"]["labels"][STATUS] == "UnschedulablePendingReboot"
    assert [t["value"] for t in node["spec"]["taints"]] == ["UnschedulablePendingReboot"]
    # A pod on no Node yet (or a Node gone) is logged, not raised.
    labels.record(health_event("UnschedulablePendingReplacement"), pod_on(None))
    labels.record(health_event("UnschedulablePendingReplacement"), pod_on("no-such-node"))
    # HyperPod's keys.
    other = new_node(api)
    hyperpod = NodeHealthLabels(api, OperatorConfig(hyperpod_labels=True), "ml/gpt")
    hyperpod.record(health_event("UnschedulablePendingReplacement"), pod_on(other))
    assert api.get_node(other)["metadata"]["labels"] == {
        "sagemaker.amazonaws.com/node-health-status": "UnschedulablePendingReplacement",
        "sagemaker.amazonaws.com/fault-type": "NodeUnhealthy",  # no check or finding: asked
        "sagemaker.amazonaws.com/fault-reason": "ReplacementRequested",
    }


def test_a_node_is_labelled_only_for_what_is_the_nodes_fault(api: KubeApi) -> None:
    """A full /dev/shm or job dir, memory pressure or a slow all-reduce is the pod's (or
    the workloads'): the job node is replaced, but its Kubernetes Node is not labelled."""
    labels = NodeHealthLabels(api, OperatorConfig(), "ml/gpt")

    def cause(kind: str, data: Obj, at: float, node: str = "node-0") -> Event:
        return Event(at, kind, "", 0, node, data=data)

    def unhealthy(at: float, status: str = "Unschedulable") -> Event:
        return Event(at, "NodeHealth", "", 0, "node-0", data={"status": status, "reason": "r"})

    shm, cpu = new_node(api), new_node(api)
    labels.record(cause("HealthCheck", {"name": "shm", "outcome": "failed"}, 1.0), pod_on(shm))
    labels.record(unhealthy(1.0), pod_on(shm))
    assert STATUS not in api.get_node(shm)["metadata"]["labels"]
    disk = cause("HealthFinding", {"kind": "DiskSpace", "action": "replace"}, 2.0)
    labels.record(disk, pod_on(shm))
    labels.record(unhealthy(2.0, "UnschedulablePendingReplacement"), pod_on(shm))
    assert STATUS not in api.get_node(shm)["metadata"]["labels"]
    # One failed check of the Node's among them is enough.
    labels.record(cause("HealthCheck", {"name": "cpu", "outcome": "failed"}, 3.0), pod_on(cpu))
    labels.record(cause("HealthCheck", {"name": "shm", "outcome": "failed"}, 3.0), pod_on(cpu))
    labels.record(unhealthy(3.0), pod_on(cpu))
    assert api.get_node(cpu)["metadata"]["labels"][STATUS] == "Unschedulable"
    # An XID is the Node's; a cause of another moment is not this event's.
    xid = cause("HealthFinding", {"kind": "XID", "action": "reboot"}, 4.0)
    labels.record(xid, pod_on(shm))
    labels.record(unhealthy(4.0, "UnschedulablePendingReboot"), pod_on(shm))
    assert api.get_node(shm)["metadata"]["labels"][STATUS] == "UnschedulablePendingReboot"
    # A rehearsal's injected failure is not the Node's either.
    rehearsed = new_node(api)
    injected = {"name": "gpu", "outcome": "failed", "evidence": {"injected": True}}
    labels.record(cause("HealthCheck", injected, 4.5), pod_on(rehearsed))
    labels.record(unhealthy(4.5), pod_on(rehearsed))
    assert STATUS not in api.get_node(rehearsed)["metadata"]["labels"]
    other = new_node(api)
    labels.record(cause("HealthCheck", {"name": "shm", "outcome": "failed"}, 5.0), pod_on(other))
    labels.record(unhealthy(6.0, "UnschedulablePendingReplacement"), pod_on(other))
    assert api.get_node(other)["metadata"]["labels"][STATUS] == "UnschedulablePendingReplacement"
    # Beside the status, the fault: the Node's own cause, in HyperPod's label keys' names.
    assert {k: v for k, v in api.get_node(cpu)["metadata"]["labels"].items() if "fault" in k} == {
        FAULT_TYPE: "HealthCheckFailed",
        FAULT_REASON: "cpu",
    }
    assert api.get_node(shm)["metadata"]["labels"][FAULT_TYPE] == "NodeUnhealthy"
    assert api.get_node(shm)["metadata"]["labels"][FAULT_REASON] == "XID"
    assert api.get_node(other)["metadata"]["labels"][FAULT_REASON] == "ReplacementRequested"


def _job_body(name: str) -> Obj:
    container = {"name": "trainer", "image": "trainguard:test", "command": ["python", "x.py"]}
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [
                {"name": "pods", "replicas": 2, "template": {"spec": {"containers": [container]}}}
            ],
            "trainguard": {"pollIntervalSeconds": 0.3},
        },
    }


def place(api: KubeApi, job: KubeJob, hosts: dict[str, str]) -> None:
    """What a kubelet does: each node id's pod onto its host, running, with an IP."""
    assert job.platform is not None
    for index, (node_id, host) in enumerate(hosts.items()):
        name = job.platform.nodes[node_id].pod_name
        api.core.patch_namespaced_pod(
            name, "default", {"spec": {"nodeName": host}}, _preload_content=False
        )
        status = {"status": {"phase": "Running", "podIP": f"127.78.0.{index + 2}"}}
        api.core.patch_namespaced_pod_status(name, "default", status, _preload_content=False)


@pytest.fixture
def job(api: KubeApi) -> Iterator[KubeJob]:
    """A job set up on the emulator with its first pods created (no kubelet: tests place
    them)."""
    job = KubeJob(api, _job_body(f"job-{next(_names)}"), OperatorConfig(), Metrics())
    platform, _ = job._set_up()
    execute(platform, job.controller.start(time.time()))
    try:
        yield job
    finally:
        job.close()


def test_a_node_labelled_for_replacement_by_hand_moves_the_pod_on_it(
    api: KubeApi, job: KubeJob
) -> None:
    platform = job.platform
    assert platform is not None
    bad, good = new_node(api), new_node(api)
    place(api, job, {"node-0": bad, "node-1": good})
    now = time.time() + 1  # past the poll interval since the set-up's listing
    assert platform.observe(now).replace == ()  # healthy Nodes: nothing to do
    pod = platform.nodes["node-0"].pod_name
    patch = {
        "metadata": {
            "labels": {STATUS: "UnschedulablePendingReplacement"},
            "annotations": {REASON: "fan failure"},
        }
    }
    api.patch_node(bad, patch)
    seen = platform.observe(now + 0.1)
    assert seen.replace == ()  # the pods are listed at most once per poll interval
    seen = platform.observe(now + 1)
    assert seen.replace == (
        Replace(
            "node-0",
            f"its pod {pod} is on Node {bad}, labelled {STATUS}=UnschedulablePendingReplacement "
            "(fan failure)",
        ),
    )
    assert platform.observe(now + 2).replace == ()  # once per node and pod
    # The controller replaces it (drive hands it over); the operator labels the Node as
    # its own for that node, and asks for nothing more.
    job.controller.replace_nodes(now + 2, [(r.node_id, r.reason) for r in seen.replace])
    platform.record(job.controller, seen)
    events = [e for e in api.list_events("default", job.name) if e["reason"] == "NodeHealth"]
    assert len(events) == 1 and "UnschedulablePendingReplacement" in events[0]["message"]
    assert events[0]["type"] == "Warning"
    node = api.get_node(bad)
    assert node["spec"]["taints"] == [
        {"key": TAINT, "value": "UnschedulablePendingReplacement", "effect": "NoSchedule"}
    ]
    assert node["metadata"]["annotations"][REASON].startswith(f"default/{job.name} node-0: ")
    # A Node labelled for a reboot moves the job's pod off it too.
    api.patch_node(good, {"metadata": {"labels": {STATUS: "UnschedulablePendingReboot"}}})
    moved = platform.observe(now + 3).replace
    assert [r.node_id for r in moved] == ["node-1"]
    assert f"labelled {STATUS}=UnschedulablePendingReboot" in moved[0].reason


def test_a_node_the_operator_labelled_for_a_job_node_asks_for_no_replacement(
    api: KubeApi, job: KubeJob
) -> None:
    platform = job.platform
    assert platform is not None
    sick, fine = new_node(api), new_node(api)
    place(api, job, {"node-0": sick, "node-1": fine})
    now = time.time() + 1  # past the poll interval since the set-up's listing
    seen = platform.observe(now)
    # The controller found node-0 unhealthy (here: a replacement it was asked for).
    job.controller.replace_nodes(now, [("node-0", "XID 79 on GPU 0000:01:00.0")])
    platform.record(job.controller, seen)
    labels = api.get_node(sick)["metadata"]["labels"]
    assert labels[STATUS] == "UnschedulablePendingReplacement"
    assert platform.observe(now + 1).replace == ()  # its own label, for that very node
    # Without rights on nodes (node_labels off) nothing is read or written.
    off = KubeJob(
        api, _job_body(f"job-{next(_names)}"), OperatorConfig(node_labels=False), Metrics()
    )
    assert off.node_health is None and off.record.node_health is None


def test_node_rights_are_get_list_patch_only(api: KubeApi) -> None:
    """What the operator's node calls are (kube/api.py), checked against its ClusterRole:
    Nodes read and labelled, and pods listed cluster-wide only (what the Nodes' resources
    hold, for an elastic job's capacity: kube/capacity.py)."""
    from trainguard.kube.manifests import NODE_RULES

    assert NODE_RULES == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    host = new_node(api, {STATUS: "UnschedulablePendingReboot"})
    listed = api.list_nodes(
        STATUS, ["UnschedulablePendingReplacement", "UnschedulablePendingReboot"]
    )
    assert host in {n["metadata"]["name"] for n in listed}
    assert all(
        n["metadata"]["labels"].get(STATUS)
        in ("UnschedulablePendingReplacement", "UnschedulablePendingReboot")
        for n in listed
    )
