"""Kubeflow PyTorchJob (kubeflow.org/v1) read as a TrainingJob: the conversion's units,
and the HyperPod walkthrough's manifest run locally (its command swapped for the light
fake worker: the default suite's; the manifest unchanged, GPT and all, is long)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import FAKE_WORKER, REPO, Trainguard
from trainguard.kube.cli import _checked_job
from trainguard.kube.config import OperatorConfig
from trainguard.kube.crd import crd
from trainguard.kube.plan import kube_plan
from trainguard.kube.pods import node_pod
from trainguard.platform.control_config import control_config
from trainguard.spec import SpecError, load_job, parse_job, resolve_plan
from trainguard.spec.scripts import check_scripts

EXAMPLE = REPO / "docs" / "examples" / "pytorchjob-auto-resume.yaml"
WORKER = "spec.pytorchReplicaSpecs.Worker"
COUNT = 'metadata.annotations["sagemaker.amazonaws.com/job-max-retry-count"]'


def walkthrough() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return data


def container(doc: dict[str, Any], kind: str = "Worker") -> dict[str, Any]:
    found: dict[str, Any] = doc["spec"]["pytorchReplicaSpecs"][kind]["template"]["spec"][
        "containers"
    ][0]
    return found


def problems(doc: object) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as caught:
        parse_job(doc, "job.yaml")
    return caught.value.problems


def paths(doc: object) -> list[str]:
    return [path for path, _ in problems(doc)]


def test_the_walkthroughs_manifest_becomes_two_nodes_with_the_auto_resume_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = load_job(EXAMPLE)
    warned = capsys.readouterr().err
    spec = job.spec
    assert [(g.name, g.replicas) for g in spec.replica_specs] == [("worker", 2)]
    assert spec.run_policy.job_max_retry_count == 2  # the annotation's count
    assert spec.run_policy.clean_pod_policy == "None"  # Kubeflow's default
    assert spec.elastic_policy is not None
    assert (spec.elastic_policy.min_replicas, spec.elastic_policy.max_replicas) == (1, 64)
    pod = spec.replica_specs[0].template.spec.model_dump(by_alias=True)
    assert pod["nodeSelector"] == {"sagemaker.amazonaws.com/node-health-status": "Schedulable"}
    assert job.metadata.annotations["trainguard.dev/converted-from"] == "kubeflow.org/v1 PyTorchJob"
    plan = resolve_plan(job, str(EXAMPLE))
    assert (plan.nnodes, plan.nproc_per_node, plan.max_restarts) == (2, 2, 2)
    assert plan.groups[0].command[2] == "examples/gpt/train.py"  # torchrun stripped
    for field in (
        "elasticPolicy.maxRestarts",
        "elasticPolicy.rdzvBackend",
        "elasticPolicy.metrics",
    ):
        assert f"{EXAMPLE}: spec.{field}: ignored: " in warned, warned


def test_master_and_workers_are_one_group_of_nodes_from_one_template() -> None:
    doc = walkthrough()
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    replicas["Worker"]["replicas"] = 3
    replicas["Master"] = copy.deepcopy(replicas["Worker"])
    replicas["Master"]["replicas"] = 1
    job = parse_job(doc, "job.yaml")
    assert [(g.name, g.replicas) for g in job.spec.replica_specs] == [("worker", 4)]

    del replicas["Worker"]  # a Master alone is a one-node job
    job = parse_job(copy.deepcopy(doc), "job.yaml")
    assert [(g.name, g.replicas) for g in job.spec.replica_specs] == [("master", 1)]

    replicas["Master"]["replicas"] = 2
    assert problems(doc) == [
        ("spec.pytorchReplicaSpecs.Master.replicas", "must be 1 (a PyTorchJob has one Master)")
    ]


def with_master(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with a Master like its Worker (2 replicas): 3 nodes, as torchrun says."""
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    replicas["Master"] = copy.deepcopy(replicas["Worker"])
    replicas["Master"]["replicas"] = 1
    for kind in ("Master", "Worker"):
        command = container(doc, kind)["command"]
        command[command.index("--nnodes=2")] = "--nnodes=3"
    return doc


def test_a_master_template_unlike_the_workers_is_a_group_of_its_own_node_0() -> None:
    doc = with_master(walkthrough())
    master = doc["spec"]["pytorchReplicaSpecs"]["Master"]
    del master["template"]["spec"]["nodeSelector"]  # the health label on the Workers only
    job = parse_job(copy.deepcopy(doc), "job.yaml")
    assert [(g.name, g.replicas) for g in job.spec.replica_specs] == [("master", 1), ("worker", 2)]
    selectors = [g.template.spec.model_dump(by_alias=True).get("nodeSelector")
                 for g in job.spec.replica_specs]  # fmt: skip
    assert selectors == [None, {"sagemaker.amazonaws.com/node-health-status": "Schedulable"}]
    plan = resolve_plan(job, "job.yaml")
    assert (plan.nnodes, plan.nproc_per_node) == (3, 2)
    config, groups = control_config(plan, "job", durable=False)
    assert config.node_ids == ("node-0", "node-1", "node-2")
    assert [(index, group.name) for index, group in groups.values()] == [
        (0, "master"),  # node-0
        *[(1, "worker")] * 63,  # node-1, node-2, and those the job may grow onto (to 64)
    ]
    # One retry budget for the job: their restart policies must agree.
    master["restartPolicy"] = "Never"
    assert problems(copy.deepcopy(doc)) == [
        (f"{WORKER}.restartPolicy", "must be the Master's (Never)")
    ]
    # ... and so must their workers per node, read from the GPU limits.
    master["restartPolicy"] = "OnFailure"
    container(doc, "Master")["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    container(doc)["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    for kind in ("Master", "Worker"):
        container(doc, kind)["command"] = ["python", "train.py"]
    [(where, message)] = problems(copy.deepcopy(doc))
    assert where == f"{WORKER}.template.spec.containers[pytorch].resources.limits[nvidia.com/gpu]"
    assert message.startswith("disagrees with spec.pytorchReplicaSpecs.Master.template"), message
    container(doc)["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    assert parse_job(doc, "job.yaml").spec.nproc_per_node == "8"


def test_a_two_group_jobs_plan_problems_name_the_master_or_the_worker(tmp_path: Path) -> None:
    doc = with_master(walkthrough())
    container(doc, "Master")["image"] = "other:1"
    for kind, script in (("Master", "/fsdp/master.py"), ("Worker", "/fsdp/train.py")):
        command = container(doc, kind)["command"]
        command[command.index("examples/gpt/train.py")] = script
    plan = resolve_plan(parse_job(doc, "job.yaml"), "job.yaml")
    with pytest.raises(SpecError) as caught:
        check_scripts(plan, "job.yaml", tmp_path)
    assert [path for path, _ in caught.value.problems] == [
        f"spec.pytorchReplicaSpecs.{kind}.template.spec.containers[0].command"
        for kind in ("Master", "Worker")
    ]


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d["spec"]["pytorchReplicaSpecs"].update(Launcher={}), "Launcher"),
        (lambda d: d["spec"].update(successPolicy="x"), "spec.successPolicy"),
        (lambda d: d["spec"].update(runPolicy={"x": 1}), "spec.runPolicy.x"),
        (lambda d: d["spec"]["elasticPolicy"].update(maxRestarts="9"),
         "spec.elasticPolicy.maxRestarts"),
        (lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(restartPolicy="Sometimes"),
         f"{WORKER}.restartPolicy"),
        (lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas=-1),
         f"{WORKER}.replicas"),
        (lambda d: container(d).update(name="trainer"), f"{WORKER}.template.spec.containers"),
        (lambda d: d["metadata"]["annotations"].update(
            {"sagemaker.amazonaws.com/job-max-retry-count": "two"}), COUNT),
        (lambda d: d["metadata"]["annotations"].update(
            {"sagemaker.amazonaws.com/enable-job-auto-resume": "yes"}),
         'metadata.annotations["sagemaker.amazonaws.com/enable-job-auto-resume"]'),
        (lambda d: (d["spec"]["elasticPolicy"].update(nProcPerNode=2),
                    d["spec"].update(nprocPerNode="3")), "spec.elasticPolicy.nProcPerNode"),
        # Errors of the TrainingJob underneath name the PyTorchJob's fields.
        (lambda d: container(d).update(command="torchrun"),
         f"{WORKER}.template.spec.containers[0].command"),
        (lambda d: d["spec"].update(nprocPerNode="lots"), "spec.nprocPerNode"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_naming_them(change: Any, where: str) -> None:
    doc = walkthrough()
    change(doc)
    found = paths(doc)
    assert any(path.endswith(where) for path in found), found


def test_the_retry_budget_comes_from_auto_resume_then_backoff_limit_then_max_restarts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def budget(doc: dict[str, Any]) -> int | None:
        return parse_job(doc, "job.yaml").spec.run_policy.job_max_retry_count

    doc = walkthrough()
    doc["spec"]["runPolicy"] = {"backoffLimit": 5}
    assert budget(copy.deepcopy(doc)) == 2  # the annotation's
    annotations = doc["metadata"]["annotations"]
    del annotations["sagemaker.amazonaws.com/job-max-retry-count"]
    assert budget(copy.deepcopy(doc)) == 1  # auto-resume's default, as hyperpod start-job's
    annotations["sagemaker.amazonaws.com/enable-job-auto-resume"] = "false"
    assert budget(copy.deepcopy(doc)) == 5  # runPolicy.backoffLimit
    del doc["spec"]["runPolicy"]
    assert budget(copy.deepcopy(doc)) == 100  # elasticPolicy.maxRestarts (torchrun's)
    doc["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Never"
    assert budget(copy.deepcopy(doc)) == 0
    capsys.readouterr()
    annotations["sagemaker.amazonaws.com/job-max-retry-count"] = "4"
    parse_job(doc, "job.yaml")
    assert f"{COUNT}: ignored: auto-resume is off" in capsys.readouterr().err


def test_workers_per_node_from_the_spec_else_the_gpu_limit() -> None:
    doc = walkthrough()
    container(doc)["command"] = ["python", "train.py"]
    container(doc)["resources"] = {"limits": {"nvidia.com/gpu": 4}}
    assert parse_job(copy.deepcopy(doc), "job.yaml").spec.nproc_per_node == "4"
    doc["spec"]["elasticPolicy"]["nProcPerNode"] = 3
    assert parse_job(copy.deepcopy(doc), "job.yaml").spec.nproc_per_node == "3"
    doc["spec"]["nprocPerNode"] = "3"
    assert parse_job(doc, "job.yaml").spec.nproc_per_node == "3"


def test_a_pytorch_container_not_first_is_the_one_that_runs_and_other_kinds_are_refused() -> None:
    doc = walkthrough()
    pod = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["containers"].insert(0, {"name": "sidecar", "image": "busybox"})
    job = parse_job(doc, "job.yaml")
    assert job.spec.replica_specs[0].template.spec.containers[0].name == "pytorch"
    assert problems({**walkthrough(), "kind": "TFJob"}) == [
        ("kind", "must be PyTorchJob for apiVersion kubeflow.org/v1")
    ]


def test_problems_found_in_the_plan_name_the_pytorchjobs_fields(tmp_path: Path) -> None:
    doc = walkthrough()
    command = container(doc)["command"]
    command[command.index("--nnodes=2")] = "--nnodes=3"
    with pytest.raises(SpecError) as caught:
        resolve_plan(parse_job(copy.deepcopy(doc), "job.yaml"), "job.yaml")
    assert [path for path, _ in caught.value.problems] == [f"{WORKER}.replicas"]
    command[command.index("--nnodes=3")] = "--nnodes=2"
    command[command.index("examples/gpt/train.py")] = "/fsdp/train.py"  # the image's
    plan = resolve_plan(parse_job(doc, "job.yaml"), "job.yaml")
    with pytest.raises(SpecError) as caught:
        check_scripts(plan, "job.yaml", tmp_path)
    assert caught.value.problems == [
        (f"{WORKER}.template.spec.containers[0].command", "script /fsdp/train.py: not found")
    ]


def local_manifest(tmp_path: Path, out: Path, *worker_args: str) -> Path:
    """The walkthrough's manifest with its command swapped for the light fake worker (same
    torchrun line), and a quick poll."""
    doc = walkthrough()
    container(doc)["command"] = [
        "/usr/local/bin/torchrun",
        "--nproc_per_node=2",
        "--nnodes=2",
        "--rdzv-conf=timeout=1800",
        str(FAKE_WORKER),
        "--out",
        str(out),
        *worker_args,
    ]
    path = tmp_path / "pytorchjob.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_locally_a_failing_rank_is_resumed_up_to_the_annotations_count(
    tg: Trainguard, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # Rank 1 fails on attempts 0 and 1: two restarts, within the count of 2.
    done = tg.run("run", "-f", str(local_manifest(tmp_path, out, "--fail-rank", "1",
                                                  "--fail-attempts", "2")))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "restart 2 of spec.runPolicy.jobMaxRetryCount=2" in done.stderr
    assert sorted(p.name for p in out.glob("rank-*-attempt-2.json")) == [
        f"rank-{r}-attempt-2.json" for r in range(4)
    ]


@pytest.mark.long
def test_locally_the_job_fails_once_the_count_is_spent(tg: Trainguard, tmp_path: Path) -> None:
    out = tmp_path / "again"
    done = tg.run("run", "-f", str(local_manifest(tmp_path, out, "--fail-rank", "1",
                                                  "--fail-attempts", "-1")))  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "retry budget exhausted (spec.runPolicy.jobMaxRetryCount=2, restarts=2)" in done.stderr
    assert not list(out.glob("rank-*-attempt-3.json"))


def test_submit_creates_the_converted_training_job_and_its_pods_are_valid_kubernetes(
    tmp_path: Path,
) -> None:
    body = _checked_job(str(EXAMPLE), allow_privileged=True)  # hostPath volumes
    assert (body["apiVersion"], body["kind"]) == ("trainguard.dev/v1", "TrainingJob")
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(body)  # what the API server stores
    body["metadata"]["uid"] = "0c3e9ad5-4bd3-4c1e-9a70-2b6c0d0d6b1e"
    job = parse_job(body, "stored")
    plan = kube_plan(job, "stored", allow_privileged=True)
    settings = OperatorConfig(hyperpod_labels=True)
    pod = node_pod(job, body, 0, plan.groups[0], "node-1", "fsdp-node-1-a0", 0, settings)
    kubernetes_validate.validate(pod, "1.31", strict=True)
    # The scheduler keeps the pod to Schedulable Nodes: the template's nodeSelector, and
    # trainguard's own required affinity on the same label.
    health = "sagemaker.amazonaws.com/node-health-status"
    assert pod["spec"]["nodeSelector"] == {health: "Schedulable"}
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert {e["key"] for t in terms for e in t["matchExpressions"]} == {health}
    # A Master without the health nodeSelector: its own group, node 0, its pod without it.
    doc = with_master(walkthrough())
    del doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["nodeSelector"]
    path = tmp_path / "pytorchjob.yaml"
    path.write_text(yaml.safe_dump(doc))
    body = _checked_job(str(path), allow_privileged=True)
    jsonschema.Draft4Validator(schema).validate(body)
    body["metadata"]["uid"] = "0c3e9ad5-4bd3-4c1e-9a70-2b6c0d0d6b1e"
    job = parse_job(body, "stored")
    plan = kube_plan(job, "stored", allow_privileged=True)
    _, groups = control_config(plan, "fsdp", durable=False)
    pods = []
    for node_id in ("node-0", "node-1"):
        index, group = groups[node_id]
        pods.append(node_pod(job, body, index, group, node_id, f"fsdp-{node_id}-a0", 0, settings))
        kubernetes_validate.validate(pods[-1], "1.31", strict=True)
    assert [p["spec"].get("nodeSelector") for p in pods] == [None, {health: "Schedulable"}]
    # The hostPath volumes are refused without --allow-privileged-pods, naming the field.
    with pytest.raises(
        SpecError, match=r"spec\.pytorchReplicaSpecs\.Worker\.template\.spec\.volumes"
    ):
        _checked_job(str(EXAMPLE))


@pytest.mark.long
@pytest.mark.e2e
def test_the_walkthroughs_manifest_trains_unchanged_locally(tg: Trainguard) -> None:
    done = tg.run("run", "-f", str(EXAMPLE), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "JobSucceeded" in done.stderr
