"""Elastic training on Kubernetes: evicted pods scale a job down, a patched replica count
scales it up, and ``status.elasticScalingStatus`` follows (kube/elastic.py).

The pure parts (eviction detection, the replica count, the status fields) are unit
tests; one job runs end to end against the emulator, its pods evicted by the harness
kubelet as a kubelet under node pressure does.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest

import control_helpers as h
from conftest import SCRIPTS, wait_for
from kube_cluster import JOB_TIMEOUT, Cluster, fake, record, running_cluster
from test_run_elastic_inplace import records
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.contact import ContactRule
from trainguard.control.controller import JobController
from trainguard.control.elastic import ElasticConfig
from trainguard.control.reports import NodeState
from trainguard.kube.api import KubeApi, KubeError
from trainguard.kube.config import GROUP, PLURAL, VERSION, OperatorConfig
from trainguard.kube.elastic import Preemptions, ReplicaCount, preemption, replica_count
from trainguard.kube.kube_platform import KubePlatform, Outside
from trainguard.kube.node import PodNode
from trainguard.kube.record import ClusterRecord
from trainguard.kube.status import Conditions, FaultyPods, ScalingStatus, job_status
from trainguard.platform.book import ReportBook
from trainguard.platform.transport import AgentTransport
from trainguard.spec import parse_job
from trainguard.wire.status import WorkerState

Obj = dict[str, Any]
LABELS = {"trainguard.dev/job": "job"}


def pod(name: str, phase: str = "Running", **status: Any) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "default", "labels": LABELS},
        "status": {"phase": phase, "podIP": "10.0.0.1", **status},
    }


def disruption(reason: str, state: str = "True") -> Obj:
    return {"type": "DisruptionTarget", "status": state, "reason": reason, "message": "why"}


# -- the facts the platform reports -------------------------------------------------------


def test_an_evicted_or_disrupted_pod_is_preempted_and_others_are_not() -> None:
    evicted = pod("a", "Failed", reason="Evicted", message="The node was low on memory.")
    assert preemption(evicted) == "Evicted: The node was low on memory."
    for reason in ("PreemptionByScheduler", "EvictionByEvictionAPI", "TerminationByKubelet"):
        why = preemption(pod("a", conditions=[{"type": "Ready"}, disruption(reason)]))
        assert why == f"{reason}: why"
    assert preemption(pod("a", conditions=[disruption("PreemptionByScheduler", "False")])) is None
    assert preemption(pod("a", "Failed", reason="Error")) is None  # a crash is not a preemption
    assert preemption(pod("a")) is None and preemption(None) is None


def test_a_node_stays_preempted_while_its_pod_is_the_preempted_one() -> None:
    preemptions = Preemptions("default/job")
    nodes = {"node-0": PodNode("node-0", "p0"), "node-1": PodNode("node-1", "p1")}
    nodes["node-0"].observe(pod("p0"))
    nodes["node-1"].observe(pod("p1", conditions=[disruption("EvictionByEvictionAPI")]))
    assert preemptions.observe(nodes) == ("node-1",)
    nodes["node-1"].observe(None)  # the evicted pod is gone before the job gave it up
    assert preemptions.observe(nodes) == ("node-1",)
    nodes["node-1"] = PodNode("node-1", "p1-new")  # the node's next pod is not preempted
    nodes["node-1"].observe(pod("p1-new"))
    assert preemptions.observe(nodes) == ()


class FakeJobs:
    """``KubeApi.get_job`` and ``list_pods`` over in-memory objects, counting reads."""

    def __init__(self, replicas: list[int], pods: list[Obj] | None = None) -> None:
        self.replicas = replicas
        self.pods = pods or []
        self.reads = 0
        self.fail = False

    def get_job(self, namespace: str, name: str) -> Obj:
        self.reads += 1
        if self.fail:
            raise KubeError("503 unavailable", 503)
        groups = [{"name": f"g{i}", "replicas": r} for i, r in enumerate(self.replicas)]
        return {"spec": {"replicaSpecs": groups}}

    def list_pods(self, namespace: str, selector: Mapping[str, str]) -> list[Obj]:
        return self.pods


def test_the_replica_count_is_reread_at_most_once_per_interval() -> None:
    assert replica_count({"spec": {"replicaSpecs": [{"replicas": 2}, {}]}}) == 3
    assert replica_count({"spec": {"replicaSpecs": [{"replicas": "x"}]}}) is None
    assert replica_count({"spec": {}}) is None
    jobs = FakeJobs([2])
    count = ReplicaCount(cast(KubeApi, jobs), "default", "job", initial=2, interval=1.0)
    assert count.read(10.0) == 2 and jobs.reads == 1
    jobs.replicas = [2, 1]  # kubectl patch: one more node
    assert count.read(10.5) == 2 and jobs.reads == 1  # within the interval: not re-read
    assert count.read(11.0) == 3 and jobs.reads == 2
    jobs.fail = True
    assert count.read(12.0) == 3  # the API is down: the last count stands


def platform(jobs: FakeJobs, elastic: bool) -> KubePlatform:
    spec: Obj = {
        "replicaSpecs": [
            {
                "name": "pods",
                "replicas": 2,
                "template": {"spec": {"containers": [{"name": "c", "image": "i"}]}},
            }
        ],
    }
    if elastic:
        spec["elasticPolicy"] = {"minReplicas": 1, "maxReplicas": 3}
    meta = {"name": "job", "namespace": "default"}
    body = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": meta,
        "spec": spec,
    }
    book = ReportBook()
    transport = AgentTransport(book, "token", poll_interval=1.0)
    kube = KubePlatform(
        cast(KubeApi, jobs),
        parse_job(body, "job"),
        body,
        OperatorConfig(),
        {},
        transport,
        cast(ClusterRecord, None),
        Outside(book),
        poll_interval=1.0,
        contact_rule=ContactRule(3),
    )
    for node_id, name in (("node-0", "p0"), ("node-1", "p1")):
        kube.nodes[node_id] = PodNode(node_id, name)
        book.reset(node_id, name)
    return kube


def test_the_platform_reports_capacity_and_preempted_nodes_of_elastic_jobs_only() -> None:
    jobs = FakeJobs([3], [pod("p0"), pod("p1", conditions=[disruption("PreemptionByScheduler")])])
    seen = platform(jobs, elastic=True).observe(100.0)
    assert seen.capacity == 3 and tuple(seen.preempted) == ("node-1",)
    assert seen.reports["node-1"].gone is None  # still running: the job gives it up first
    plain = platform(jobs, elastic=False).observe(100.0)
    assert plain.capacity is None and tuple(plain.preempted) == ()


# -- status.elasticScalingStatus ------------------------------------------------------------


def elastic_controller() -> JobController:
    config = ControlConfig(
        "job",
        ("node-0", "node-1"),
        2,
        elastic=ElasticConfig(1, 3, scaling_timeout=1.0),
        elastic_node_ids=("node-2",),
        stop_grace_seconds=5,
    )
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))
    h.begin(c)
    c.set_capacity(2)
    return c


def stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_elastic_scaling_status_follows_a_scale_down() -> None:
    c = elastic_controller()
    scaling = ScalingStatus()
    before = scaling.to_json(c, 0.5)
    assert before == {
        "targetReplicas": 2,
        "lastScalingTime": None,
        "lastRestartTime": None,
        "podsScaled": 0,
        "isFaultyPodScaleDown": False,
        "consecutiveScalingFailures": 0,
        "lastUpdated": stamp(0.5),
    }
    assert scaling.to_json(c, 0.9) == before  # unchanged: lastUpdated stays

    c.set_capacity(2, ["node-1"])
    c.observe(1.0, h.reports(("node-0", "node-1"), NodeState.RUNNING, 0))  # a graceful stop
    stopping = scaling.to_json(c, 1.0)
    assert stopping is not None and stopping["targetReplicas"] == 1  # scaling to 1
    assert stopping["lastUpdated"] == stamp(1.0)
    stopped = {
        n: h.report(n, NodeState.STOPPED, 0, workers=h.workers(i, WorkerState.STOPPED))
        for i, n in enumerate(("node-0", "node-1"))
    }
    c.observe(3.0, stopped)
    for event in c.drain_events():
        scaling.note(event)
    after = scaling.to_json(c, 3.0)
    assert after is not None
    assert after["targetReplicas"] == 1 and after["podsScaled"] == 1
    assert after["lastScalingTime"] == stamp(3.0) == after["lastRestartTime"]
    assert not after["isFaultyPodScaleDown"] and after["consecutiveScalingFailures"] == 0
    assert c.restarts == 0

    status = job_status(c, Conditions(), [], FaultyPods(), 3.0, scaling)
    assert status["elasticScalingStatus"] == after


def test_a_job_without_elastic_policy_has_no_elastic_scaling_status() -> None:
    config = ControlConfig("job", ("node-0",), 1)
    c = JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000))
    assert ScalingStatus().to_json(c, 1.0) is None
    assert "elasticScalingStatus" not in job_status(
        c, Conditions(), [], FaultyPods(), 1.0, ScalingStatus()
    )


# -- end to end, against the emulator -------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    nodes: dict[str, dict[str, str]] = {"node-a": {}, "node-b": {}, "node-c": {}}
    with running_cluster(tmp_path_factory.mktemp("elastic"), nodes) as cluster:
        yield cluster


def worlds(out: Path, attempt: int) -> list[str]:
    """Each rank's WORLD_SIZE in ``attempt`` (the ranks that recorded one)."""
    return [
        record(out, rank, attempt)["env"]["WORLD_SIZE"]
        for rank in range(3)
        if (out / f"rank-{rank}-attempt-{attempt}.json").exists()
    ]


def first_status(cluster: Cluster, name: str, test: Callable[[Obj], bool]) -> Obj:
    """The job's status as first seen passing ``test`` (a later one may be past it: an
    elastic job scales back up to its capacity after scalingTimeoutInSeconds)."""
    seen: list[Obj] = []

    def passed() -> bool:
        seen.append(cluster.status(name))
        return test(seen[-1])

    wait_for(passed, JOB_TIMEOUT)
    return seen[-1]


def set_replicas(cluster: Cluster, name: str, replicas: int) -> None:
    """``kubectl patch`` of the job's (only) group's replica count."""
    groups = cluster.api.get_job("default", name)["spec"]["replicaSpecs"]
    groups[0]["replicas"] = replicas
    patch = {"spec": {"replicaSpecs": groups}}
    cluster.api.custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, name, patch
    )


@pytest.mark.long
def test_evicted_pods_scale_the_job_down_and_a_patched_replica_count_scales_it_up(
    cluster: Cluster,
) -> None:
    name, out = "elastic", cluster.root / "out-elastic"
    cluster.submit(
        name,
        fake(out, "--sleep", "300"),
        nprocPerNode=1,
        elasticPolicy={
            "minReplicas": 1,
            "maxReplicas": 3,
            "scalingTimeoutInSeconds": 4,
            "gracefulShutdownTimeoutInSeconds": 1,
        },
        trainguard={"pollIntervalSeconds": 0.3, "stopGracePeriodSeconds": 1},
    )
    wait_for(lambda: len(worlds(out, 0)) == 2, JOB_TIMEOUT)
    wait_for(lambda: cluster.status(name).get("phase") == "Running", JOB_TIMEOUT)
    pods = {n["nodeId"]: n["pod"] for n in cluster.status(name)["nodes"]}

    # The kubelet evicts node-1's pod (3 s of grace): the job gives the node up at once
    # and goes on with WORLD_SIZE 1; not a restart.
    cluster.kubelet.evict(pods["node-1"], grace=3.0)
    status = first_status(cluster, name, lambda s: s.get("attempt") == 1)
    wait_for(lambda: worlds(out, 1) == ["1"], JOB_TIMEOUT)
    assert [n["nodeId"] for n in status["nodes"]] == ["node-0"]
    assert status["restartCount"] == 0
    scaled = status["elasticScalingStatus"]
    assert scaled["targetReplicas"] == 1 and scaled["podsScaled"] == 1, scaled
    assert scaled["lastScalingTime"] and not scaled["isFaultyPodScaleDown"]

    # The replica count patched to 3: the new pods come up at once, and after
    # scalingTimeoutInSeconds the job grows to 3 (through 2 if the capacity of 2 it kept
    # had its turn first).
    set_replicas(cluster, name, 3)

    def grown() -> bool:
        status = cluster.status(name)
        return status.get("phase") == "Running" and worlds(out, status["attempt"]) == ["3"] * 3

    wait_for(grown, JOB_TIMEOUT)
    status = cluster.status(name)
    attempt = status["attempt"]
    assert status["restartCount"] == 0
    assert status["elasticScalingStatus"]["targetReplicas"] == 3
    assert status["elasticScalingStatus"]["consecutiveScalingFailures"] == 0

    # An eviction with no grace (the pod's processes end at once): a scale-down to 2.
    third = {n["nodeId"]: n["pod"] for n in status["nodes"]}["node-2"]
    cluster.kubelet.evict(third, grace=0.0)
    status = first_status(cluster, name, lambda s: s["attempt"] > attempt)
    wait_for(lambda: worlds(out, attempt + 1) == ["2", "2"], JOB_TIMEOUT)
    events = cluster.describe(name)["events"]
    scalings = [e["message"] for e in events if e["reason"] == "ElasticScaling"]
    assert "scale down 2 -> 1 nodes: node-1 preempted" in scalings[0], scalings
    assert any("-> 3 nodes" in m for m in scalings), scalings
    assert any("scale down 3 -> 2 nodes: node-2 preempted" in m for m in scalings), scalings
    assert "RestartScheduled" not in [e["reason"] for e in events]
    assert status["restartCount"] == 0, status
    assert status.get("faults", []) == [], status["faults"]  # taken away, not failed
    scaled = status["elasticScalingStatus"]
    assert scaled["podsScaled"] == 1 and scaled["lastRestartTime"] and scaled["lastUpdated"]

    done = cluster.tg("delete", "--kube", name, "--timeout", "60")
    assert done.returncode == 0, done.stderr


@pytest.mark.e2e
@pytest.mark.long
def test_a_resilient_job_scales_down_and_back_up_in_place(cluster: Cluster) -> None:
    """``inProcessRestart`` on Kubernetes: an evicted pod's rank leaves and the survivor
    trains on in the same process; the replica count is still 2, so a fresh pod comes up
    while it trains and joins after scalingTimeoutInSeconds, its worker taking the state
    from the survivor. No restart, no fault, every sample of the epoch taken once.

    The steps are slow from the eviction until the fresh pod's rank has started (the
    script's ``--slow-while``): a busy machine may take longer to start its worker than
    the rest of the epoch takes at full speed."""
    name, out, steps, batch = "inplace", cluster.root / "out-inplace", 400, 12
    slow = cluster.root / "slow-inplace"
    script = ["python", str(SCRIPTS / "elastic_resilient.py"), "--out", str(out), "--steps",
              str(steps), "--global-batch", str(batch), "--step-sleep", "0.05",
              "--slow-while", str(slow)]  # fmt: skip
    cluster.submit(
        name,
        script,
        nprocPerNode=1,
        elasticPolicy={"minReplicas": 1, "maxReplicas": 2, "scalingTimeoutInSeconds": 3,
                       "gracefulShutdownTimeoutInSeconds": 1},
        trainguard={"inProcessRestart": True, "pollIntervalSeconds": 0.3,
                    "stopGracePeriodSeconds": 1, "restartBarrierTimeoutSeconds": 60},
    )  # fmt: skip

    def starts(attempt: int) -> dict[int, dict[str, Any]]:
        return {r["rank"]: r for r in records(out) if r.get("attempt") == attempt
                and r["event"] == "start"}  # fmt: skip

    wait_for(lambda: len(starts(0)) == 2 and cluster.status(name).get("phase") == "Running",
             JOB_TIMEOUT)  # fmt: skip
    pods = {n["nodeId"]: n["pod"] for n in cluster.status(name)["nodes"]}
    slow.touch()
    cluster.kubelet.evict(pods["node-1"], grace=3.0)
    wait_for(lambda: len(starts(2)) == 2 or cluster.status(name).get("phase") != "Running",
             JOB_TIMEOUT)  # fmt: skip
    slow.unlink()
    status = cluster.wait_phase(name, "Succeeded", "Failed", timeout=300)
    said = cluster.resilient_lines(name)
    assert status["phase"] == "Succeeded", f"{status.get('conditions')}\n{said}"
    assert status["restartCount"] == 0 and status.get("faults", []) == [], f"{status}\n{said}"
    scalings = [e["message"] for e in cluster.describe(name)["events"]
                if e["reason"] == "ElasticScaling"]  # fmt: skip
    assert len(scalings) == 2 and all("in place" in m for m in scalings), scalings
    assert "2 -> 1 nodes" in scalings[0] and "1 -> 2 nodes" in scalings[1], scalings

    first, second, third = starts(0), starts(1), starts(2)
    assert second[0]["pid"] == third[0]["pid"] == first[0]["pid"]  # never restarted
    assert second[0]["world"] == 1 and second[0]["source"] == "self"
    assert third[1]["pid"] != first[1]["pid"] and third[1]["source"] == "peer"
    taken = [k for r in records(out) if r["event"] == "step" for k in r["samples"]]
    assert sorted(taken) == list(range(steps * batch))  # every sample of the epoch, once
