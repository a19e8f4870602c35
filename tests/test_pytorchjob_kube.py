"""The HyperPod walkthrough's PyTorchJob on the Kubernetes emulator (kmock's API server, the
harness kubelet, the operator as a process): ``trainguard submit`` converts it into a
TrainingJob, its pods go only to Nodes labelled ``node-health-status: Schedulable`` (the
manifest's nodeSelector), and it is resumed on healthy Nodes up to its auto-resume count.

The manifest is docs/examples/pytorchjob-auto-resume.yaml with its command's script
swapped for the light fake worker (the same torchrun line); the operator is installed as
the walkthrough needs it: HyperPod's label names, and hostPath volumes allowed.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conftest import FAKE_WORKER, REPO, wait_for
from kube_cluster import JOB_TIMEOUT, Cluster, running_cluster

pytestmark = pytest.mark.long  # a cluster and an operator of its own, three attempts

EXAMPLE = REPO / "docs" / "examples" / "pytorchjob-auto-resume.yaml"
HEALTH = "sagemaker.amazonaws.com/node-health-status"
SCHEDULABLE = {HEALTH: "Schedulable"}
HEALTHY = {"hp-a", "hp-b", "hp-c"}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The emulator on Nodes labelled as HyperPod labels them; the operator as installed
    with --hyperpod-labels --allow-privileged-pods."""
    monkeypatch.setenv("TRAINGUARD_HYPERPOD_LABELS", "true")
    monkeypatch.setenv("TRAINGUARD_ALLOW_PRIVILEGED_PODS", "true")  # the hostPath volumes
    nodes = {
        **{name: SCHEDULABLE for name in sorted(HEALTHY)},
        # Named to sort first: the harness takes the first of the emptiest Nodes that fit.
        "a-unlabelled": {},  # no label: the nodeSelector's miss (trainguard's affinity fits)
        "a-sick": {HEALTH: "Unschedulable"},
    }
    with running_cluster(tmp_path, nodes) as cluster:
        yield cluster


def manifest(out: Path) -> dict[str, object]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    pod = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    script = command.index("examples/gpt/train.py")
    pod["containers"][0]["command"] = [*command[:script], str(FAKE_WORKER), "--out", str(out),
                                       "--sleep", "300"]  # fmt: skip
    pod["containers"][0]["workingDir"] = str(REPO)
    return dict(doc)


def hosts(cluster: Cluster) -> set[str]:
    return {n["hostNode"] for n in cluster.status("fsdp")["nodes"]}


def test_walkthrough_pytorchjob_is_resumed_on_schedulable_nodes_up_to_its_count(
    cluster: Cluster,
) -> None:
    out = cluster.root / "out"
    path = cluster.root / "pytorchjob.yaml"
    path.write_text(yaml.safe_dump(manifest(out)))
    done = cluster.tg("submit", "-f", str(path), "-n", "default", "--allow-privileged-pods")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trainingjob/fsdp created in namespace default"
    assert "spec.elasticPolicy.rdzvBackend: ignored" in done.stderr
    stored = cluster.api.get_job("default", "fsdp")
    assert stored["spec"]["runPolicy"]["jobMaxRetryCount"] == 2

    def attempt_running(attempt: int) -> bool:
        if not all((out / f"rank-{r}-attempt-{attempt}.json").exists() for r in range(4)):
            return False
        nodes = cluster.status("fsdp").get("nodes") or []
        return len(nodes) == 2 and all(n.get("hostNode") for n in nodes)

    wait_for(lambda: attempt_running(0), JOB_TIMEOUT)
    assert len(hosts(cluster)) == 2 and hosts(cluster) <= HEALTHY

    # A pod dies (its agent and workers): restart 1 of 2, on Schedulable Nodes again.
    first = cluster.status("fsdp")["nodes"]
    cluster.kubelet.kill_pod(first[0]["pod"])
    wait_for(lambda: attempt_running(1) and cluster.status("fsdp")["attempt"] == 1, JOB_TIMEOUT)
    assert hosts(cluster) <= HEALTHY

    # HyperPod marks the idle healthy Node for a reboot, and a pod dies again: restart 2
    # of 2, on the Schedulable Nodes that are left.
    marked = sorted(HEALTHY - hosts(cluster))[0]
    cluster.api.patch_node(marked, {"metadata": {"labels": {HEALTH: "UnschedulablePendingReboot"}}})
    cluster.kubelet.kill_pod(cluster.status("fsdp")["nodes"][0]["pod"])
    wait_for(lambda: attempt_running(2) and cluster.status("fsdp")["attempt"] == 2, JOB_TIMEOUT)
    assert hosts(cluster) == HEALTHY - {marked}
    assert cluster.status("fsdp")["restartCount"] == 2

    # The count is spent: the next fault fails the job.
    cluster.kubelet.kill_pod(cluster.status("fsdp")["nodes"][1]["pod"])
    status = cluster.wait_phase("fsdp", "Failed", "Succeeded")
    assert status["phase"] == "Failed", status
    assert "jobMaxRetryCount=2" in status["reason"], status
    assert not (out / "rank-0-attempt-3.json").exists()


@pytest.mark.e2e
def test_walkthrough_pytorchjob_trains_unchanged_on_the_emulator(cluster: Cluster) -> None:
    """The manifest as it is (the GPT example's script, 2 pods x 2 processes): the harness
    kubelet runs a pod's command in its root, where the example's script is put, as the
    image would hold it."""
    shutil.copytree(REPO / "examples" / "gpt", cluster.root / "examples" / "gpt",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    done = cluster.tg("submit", "-f", str(EXAMPLE), "-n", "default", "--allow-privileged-pods")
    assert done.returncode == 0, done.stderr
    status = cluster.wait_phase("fsdp", "Succeeded", "Failed", timeout=2 * JOB_TIMEOUT)
    assert status["phase"] == "Succeeded", status
    assert {n["hostNode"] for n in status["nodes"]} <= HEALTHY
    logs = cluster.tg("logs", "--kube", "fsdp", "--rank", "0")
    assert "Batch 40 Loss:" in logs.stdout, logs.stdout[-2000:]


def test_a_master_without_the_health_selector_is_node_0_of_its_own_group(cluster: Cluster) -> None:
    """Master and Worker templates that differ (the health nodeSelector on the Workers
    only): two node groups, the Master's node 0 and rank 0, placed by its own template."""
    out = cluster.root / "out"
    doc = manifest(out)
    replicas = doc["spec"]["pytorchReplicaSpecs"]  # type: ignore[index]
    master = copy.deepcopy(replicas["Worker"])
    master["replicas"] = 1
    del master["template"]["spec"]["nodeSelector"]
    replicas["Master"] = master
    for replica in replicas.values():
        command = replica["template"]["spec"]["containers"][0]["command"]
        command[command.index("--nnodes=2")] = "--nnodes=3"
        command[command.index("--sleep") + 1] = "0"
    path = cluster.root / "pytorchjob.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = cluster.tg("submit", "-f", str(path), "-n", "default", "--allow-privileged-pods")
    assert done.returncode == 0, done.stderr
    stored = cluster.api.get_job("default", "fsdp")
    assert [g["name"] for g in stored["spec"]["replicaSpecs"]] == ["master", "worker"]
    status = cluster.wait_phase("fsdp", "Succeeded", "Failed")
    assert status["phase"] == "Succeeded", status
    nodes = {n["nodeId"]: n for n in status["nodes"]}
    assert (nodes["node-0"]["nodeRank"], nodes["node-0"]["ranks"]) == (0, [0, 1])
    # The Master's pod goes to the unlabelled Node (the emptiest, first by name: trainguard's
    # own affinity only keeps it off unhealthy ones); the Workers' only to Schedulable ones.
    assert nodes["node-0"]["hostNode"] == "a-unlabelled"
    assert {nodes[n]["hostNode"] for n in ("node-1", "node-2")} <= HEALTHY
    assert sorted(p.name for p in out.glob("rank-*-attempt-0.json")) == [
        f"rank-{r}-attempt-0.json" for r in range(6)
    ]
