"""Loading job files: file and YAML problems, apiVersion/kind, HyperPodPyTorchJob manifests."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from trainguard.spec import SpecError, load_job, parse_job, resolve_plan

DATA = Path(__file__).parent / "data"
STARTING_SPEC = Path(__file__).parent.parent / "docs" / "examples" / "job-minimal.yaml"


def load_error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_job(path)
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    err = load_error(path)
    assert str(err) == f"{path}: file not found"
    assert err.source == str(path)
    assert err.problems == [("", "file not found")]


def test_directory_instead_of_file(tmp_path: Path) -> None:
    assert str(load_error(tmp_path)) == f"{tmp_path}: is a directory, not a job spec file"


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: trainguard.dev/v1\nkind: TrainingJob\nmetadata: [oops\n")
    text = str(load_error(path))
    assert text.startswith(f"{path}: invalid YAML at line ")
    assert "line 4" in text or "line 3" in text


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: trainguard.dev/v1\nkind: TrainingJob\nkind: TrainingJob\n")
    assert str(load_error(path)) == (
        f"{path}: invalid YAML at line 3, column 1: duplicate key 'kind'"
    )


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("- a\n- b\n")
    assert str(load_error(path)) == (
        f"{path}: expected a mapping (apiVersion, kind, metadata, spec), got a list"
    )
    path.write_text("")
    assert str(load_error(path)) == f"{path}: empty document; expected a TrainingJob mapping"


def test_wrong_api_version_and_kind(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: batch/v1\nkind: Job\n")
    assert str(load_error(path)) == (
        f"{path}: apiVersion: must be trainguard.dev/v1 (or sagemaker.amazonaws.com/v1, "
        "or kubeflow.org/v1 for a PyTorchJob)"
    )
    path.write_text("apiVersion: trainguard.dev/v1\nkind: PyTorchJob\n")
    assert str(load_error(path)) == (
        f"{path}: kind: must be TrainingJob for apiVersion trainguard.dev/v1"
    )
    path.write_text("metadata: {name: x}\n")
    assert str(load_error(path)).splitlines() == [
        f"{path}: apiVersion: field required",
        f"{path}: kind: field required",
    ]


def test_validation_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    text = STARTING_SPEC.read_text().replace("replicas: 2", "replicas: 0")
    path.write_text(text)
    assert str(load_error(path)) == f"{path}: spec.replicaSpecs[0].replicas: must be >= 1"


def test_spec_error_survives_pickling() -> None:
    err = SpecError("job.yaml", [("spec.x", "unknown field")])
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == "job.yaml: spec.x: unknown field"
    assert again.problems == err.problems


def test_hyperpod_manifest_is_read_as_a_training_job() -> None:
    path = DATA / "spec_hyperpod.yaml"
    job = load_job(path)
    assert (job.api_version, job.kind) == ("trainguard.dev/v1", "TrainingJob")
    assert job.metadata.name == "hyperpod-fsdp"
    assert job.metadata.namespace == "kubeflow"
    assert job.spec.run_policy.job_max_retry_count == 10
    assert job.spec.run_policy.clean_pod_policy == "None"
    rules = job.spec.run_policy.log_monitoring_configuration
    assert [rule.name for rule in rules] == [
        "JobStart",
        "JobHangingDetection",
        "NoSCheckpointingDetection",
    ]
    assert rules[0].log_pattern == ".*Loss:.*"
    assert rules[0].expected_start_cut_off_in_seconds == 240
    assert rules[1].expected_recurring_frequency_in_seconds == 300
    assert rules[2].expected_start_cut_off_in_seconds == 900
    plan = resolve_plan(job, str(path))
    assert (plan.nnodes, plan.nproc_per_node, plan.max_restarts) == (2, 2, 10)
    assert plan.groups[0].command[1:] == (
        "-u",
        "/fsdp/train.py",
        "--max_steps=100",
        "--model_type=llama_v3",
    )
    assert set(plan.groups[0].ignored_flags) == {
        "--server-host",
        "--server-port",
        "--tee",
        "--log-dir",
    }
    pod = job.model_dump(by_alias=True)["spec"]["replicaSpecs"][0]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}


def test_hyperpod_kind_spelling_and_status_are_tolerated() -> None:
    data = {
        "apiVersion": "sagemaker.amazonaws.com/v1",
        "kind": "HyperPodPytorchJob",
        "metadata": {"name": "x", "generateName": "x-"},
        "spec": {
            "replicaSpecs": [
                {"name": "pods", "template": {"spec": {"containers": [{"name": "c"}]}}}
            ]
        },
        "status": {"restartCount": 2},
    }
    job = parse_job(data, "hp.yaml")
    assert job.kind == "TrainingJob"


def test_hyperpod_manifest_unknown_field_is_an_error() -> None:
    data = {
        "apiVersion": "sagemaker.amazonaws.com/v1",
        "kind": "HyperPodPyTorchJob",
        "metadata": {"name": "x"},
        "spec": {
            "replicaSpecs": [
                {"name": "pods", "template": {"spec": {"containers": [{"name": "c"}]}}}
            ],
            "runPolicy": {"logMonitoringConfiguration": [{"name": "a", "logPatern": ".*"}]},
        },
    }
    with pytest.raises(SpecError) as info:
        parse_job(data, "hp.yaml")
    assert str(info.value).splitlines() == [
        "hp.yaml: spec.runPolicy.logMonitoringConfiguration[0].logPattern: field required",
        "hp.yaml: spec.runPolicy.logMonitoringConfiguration[0].logPatern: unknown field; "
        "did you mean logPattern?",
    ]


def test_hyperpod_api_with_other_kind_rejected() -> None:
    data = {"apiVersion": "sagemaker.amazonaws.com/v1", "kind": "Cluster"}
    with pytest.raises(SpecError) as info:
        parse_job(data, "hp.yaml")
    assert str(info.value) == (
        "hp.yaml: kind: must be HyperPodPyTorchJob for apiVersion sagemaker.amazonaws.com/v1"
    )
