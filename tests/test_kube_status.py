"""HyperPod's status fields as the operator's status writer (kube/record.py ``ClusterRecord``)
patches them on a TrainingJob in kmock's API server, from a real controller's decisions:
``latestFaultyPodInstanceList`` (``restartType`` PLR for an in-process or process-level
restart, JLR for new pods; the faulty pods, their Kubernetes Nodes, the ranks) and
``restartStatus``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import control_helpers as h
from kube_harness import ApiServer
from trainguard.control.actions import StopNodes
from trainguard.control.assignment import StoreEndpoint
from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController
from trainguard.control.events import Event
from trainguard.control.policy import PolicyConfig
from trainguard.control.reports import NodeState
from trainguard.kube.api import KubeApi
from trainguard.kube.config import GROUP, KIND, VERSION
from trainguard.kube.node import PodNode
from trainguard.kube.record import ClusterRecord
from trainguard.kube.status import k8s_event
from trainguard.observe.job import JobObserver

Obj = dict[str, Any]
NODES = ("node-0", "node-1")
HOSTS = {"node-0": "host-a", "node-1": "host-b"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApi]:
    server = ApiServer()
    try:
        kubeconfig = server.write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")
        yield KubeApi.connect(str(kubeconfig))
    finally:
        server.stop()


def controller(in_process: bool) -> JobController:
    config = ControlConfig(
        "job",
        NODES,
        2,
        policy=PolicyConfig.from_spec(None, 3),
        in_process=in_process,
        barrier_timeout=30.0,
        stuck_rank_timeout=3.0,
    )
    return JobController(config, lambda attempt, node: StoreEndpoint("127.0.0.1", 30000 + attempt))


def pods(generation: int) -> dict[str, PodNode]:
    """Each node's pod (``generation``: how many times the pods were made anew), on its
    Kubernetes Node."""
    out: dict[str, PodNode] = {}
    for node_id, host in HOSTS.items():
        name = f"{node_id}-p{generation}"
        pod = PodNode(node_id, name)
        pod.observe({"metadata": {"name": name}, "spec": {"nodeName": host}, "status": {}})
        out[node_id] = pod
    return out


def new_job(api: KubeApi, name: str) -> ClusterRecord:
    body: Obj = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"replicaSpecs": [{"name": "worker", "replicas": 2, "template": {}}]},
    }
    created = api.create_job("default", body)
    return ClusterRecord(api, created, JobObserver(f"default/{name}", name))


def written(
    api: KubeApi, record: ClusterRecord, c: JobController, now: float, generation: int = 0
) -> Obj:
    """Record the controller's turn with its pods, then read the job's status back."""
    seen = pods(generation)
    record.record(c, [p.info("running") for p in seen.values()], seen, now)
    status: Obj = api.get_job("default", record.name)["status"]
    return status


def test_an_in_process_restart_is_a_plr_naming_pod_node_and_rank(api: KubeApi) -> None:
    c = controller(in_process=True)
    record = new_job(api, "in-process")
    h.begin(c)
    assert "latestFaultyPodInstanceList" not in written(api, record, c, 0.5)
    running = h.report("node-0", NodeState.RUNNING, 0, workers=h.workers(0))
    c.observe(1.0, {"node-0": running, "node-1": h.crashed("node-1", 3)})
    status = written(api, record, c, 1.0)
    assert status["latestFaultyPodInstanceList"] == {
        "restartType": "PLR",  # not HyperPod's vocabulary to have an in-process kind
        "faultyPodList": ["node-1-p0"],
        "faultyInstanceIdList": ["host-b"],
        "faultyRankList": [3],
    }
    assert status["restartCount"] == 1
    assert status["restartStatus"] == {"restartCount": 1, "fullJobRestartCount": 0}


def test_process_then_job_level_restarts_are_plr_then_jlr(api: KubeApi) -> None:
    c = controller(in_process=False)
    record = new_job(api, "plr-jlr")
    h.begin(c)
    # Rank 1 crashes (node-0): every rank stops, processes restart in the same pods.
    [stop] = c.observe(1.0, h.reports(NODES, **{"node-0": h.crashed("node-0", 1)}))
    assert isinstance(stop, StopNodes)
    faulty = written(api, record, c, 1.0)["latestFaultyPodInstanceList"]
    # Decided once the ranks have stopped; null until then, which a merge patch removes.
    assert "restartType" not in faulty and faulty["faultyPodList"] == ["node-0-p0"]
    stopped = h.reports(NODES, NodeState.STOPPED, 0)
    c.observe(2.0, stopped)
    status = written(api, record, c, 2.0)
    assert status["latestFaultyPodInstanceList"] == {
        "restartType": "PLR",
        "faultyPodList": ["node-0-p0"],
        "faultyInstanceIdList": ["host-a"],
        "faultyRankList": [1],
    }
    c.observe(3.0, h.reports(NODES, NodeState.RUNNING, 1))
    # node-1 is lost: new pods for every node (a job-level restart); the list is the
    # new attempt's faults only.
    lost = h.reports(NODES, NodeState.RUNNING, 1, **{"node-1": h.lost("node-1")})
    c.observe(4.0, lost)
    c.observe(5.0, h.reports(NODES, NodeState.STOPPED, 1, **{"node-1": h.lost("node-1")}))
    status = written(api, record, c, 5.0)
    assert status["latestFaultyPodInstanceList"] == {
        "restartType": "JLR",
        "faultyPodList": ["node-1-p0"],
        "faultyInstanceIdList": ["host-b"],
        "faultyRankList": [],
    }
    assert status["restartStatus"] == {"restartCount": 1, "fullJobRestartCount": 1}


def test_a_step_that_did_not_reach_the_durable_tier_is_a_warning_event() -> None:
    """``kubectl get events`` shows a failed persist and a job that ended with its newest
    asked-for step not durable as Warnings (issue 38), a committed step as Normal."""
    job = {"metadata": {"name": "j", "namespace": "ns", "uid": "u"}}
    types = {
        kind: k8s_event(job, Event(1.0, kind, "m", data={"step": 20}), "c")["type"]
        for kind in ("CheckpointPersistFailed", "CheckpointNotDurable", "CheckpointCommitted")
    }
    assert types == {
        "CheckpointPersistFailed": "Warning",
        "CheckpointNotDurable": "Warning",
        "CheckpointCommitted": "Normal",
    }
