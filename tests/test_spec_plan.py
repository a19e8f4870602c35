"""Resolving a job into a JobPlan, and the torchrun-style command-line job."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.control.events import Fault, FaultType
from trainguard.control.policy import GiveUp, decide_restart
from trainguard.platform.control_config import control_config
from trainguard.spec import (
    JobPlan,
    SpecError,
    TrainingJob,
    cli_job,
    dns_name,
    parse_job,
    resolve_plan,
)
from trainguard.spec.scripts import check_scripts, python_script

CMD = "spec.replicaSpecs[0].template.spec.containers[0].command"


def job(
    command: list[str],
    *,
    args: list[str] | None = None,
    spec: dict[str, Any] | None = None,
    group: dict[str, Any] | None = None,
    container: dict[str, Any] | None = None,
) -> TrainingJob:
    data = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "j"},
        "spec": {
            "replicaSpecs": [
                {
                    "name": "worker",
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "c", "command": command, "args": args or []}
                                | (container or {})
                            ]
                        }
                    },
                }
                | (group or {})
            ]
        }
        | (spec or {}),
    }
    return parse_job(data, "job.yaml")


def plan_of(*args: Any, **kwargs: Any) -> JobPlan:
    return resolve_plan(job(*args, **kwargs), "job.yaml")


def plan_error(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(SpecError) as info:
        plan_of(*args, **kwargs)
    return str(info.value)


def test_plain_python_command_uses_our_interpreter_unbuffered() -> None:
    plan = plan_of(["python", "train.py"], args=["--lr", "1"])
    assert plan.groups[0].command == (sys.executable, "-u", "train.py", "--lr", "1")
    plan = plan_of(["python3", "-u", "-m", "pkg.train"])
    assert plan.groups[0].command == (sys.executable, "-u", "-m", "pkg.train")
    plan = plan_of(["/bin/echo", "hi"])
    assert plan.groups[0].command == ("/bin/echo", "hi")


def test_defaults_without_launcher() -> None:
    plan = plan_of(["python", "t.py"])
    assert (plan.name, plan.nproc_per_node, plan.nnodes, plan.max_restarts) == ("j", 1, 1, 0)
    assert plan.world_size == 1
    assert plan.active_deadline_seconds is None
    assert (plan.stop_grace_seconds, plan.poll_interval_seconds) == (10, 0.5)
    assert plan.node_start_timeout_seconds == 60
    assert plan.groups[0].env == {} and plan.groups[0].working_dir is None


def test_spec_fields_flow_into_the_plan() -> None:
    plan = plan_of(
        ["python", "t.py"],
        spec={
            "nprocPerNode": 2,
            "runPolicy": {"jobMaxRetryCount": 4, "activeDeadlineSeconds": 30},
            "trainguard": {"stopGracePeriodSeconds": 1, "nodeStartTimeoutSeconds": 5},
        },
        group={"replicas": 3, "spares": 1},
        container={"workingDir": "/tmp", "env": [{"name": "A", "value": "1"}]},
    )
    assert (plan.nproc_per_node, plan.nnodes, plan.max_restarts) == (2, 3, 4)
    assert plan.world_size == 6
    assert plan.active_deadline_seconds == 30
    assert (plan.stop_grace_seconds, plan.node_start_timeout_seconds) == (1, 5)
    group = plan.groups[0]
    assert (group.name, group.replicas, group.spares) == ("worker", 3, 1)
    assert (group.env, group.working_dir) == ({"A": "1"}, "/tmp")


def test_torchrun_line_is_stripped_and_fills_unset_fields() -> None:
    plan = plan_of(
        ["torchrun", "--nnodes=2", "--nproc-per-node=3", "--max-restarts=5", "--standalone"],
        args=["train.py", "--epochs", "1"],
    )
    assert plan.groups[0].command == (sys.executable, "-u", "train.py", "--epochs", "1")
    assert (plan.nnodes, plan.nproc_per_node, plan.max_restarts) == (2, 3, 5)
    assert plan.groups[0].ignored_flags == ("--standalone",)


def test_the_plan_says_where_the_retry_budget_was_set(tmp_path: Path) -> None:
    """And the controller's give-up reason names it (friction: --max-restarts users were
    told about jobMaxRetryCount)."""
    field = "spec.runPolicy.jobMaxRetryCount"
    assert plan_of(["python", "t.py"]).max_restarts_from == field
    assert plan_of(["torchrun", "--max-restarts=2", "t.py"]).max_restarts_from == "--max-restarts"
    spec = {"runPolicy": {"jobMaxRetryCount": 2}}
    assert plan_of(["torchrun", "--max-restarts=2", "t.py"], spec=spec).max_restarts_from == field
    script = tmp_path / "t.py"
    script.write_text("")
    built = cli_job(str(script), [], nnodes=1, nproc_per_node=1, max_restarts=0)
    plan = resolve_plan(built, "command line")
    policy = control_config(plan, "j-1", durable=False)[0].policy
    assert policy.budget_name == "--max-restarts"
    crash = Fault(FaultType.WORKER_CRASH, 0.0, 0, node="node-0", rank=0, message="rank 0 died")
    reason = decide_restart(0.0, [crash], [], {}, ["node-0"], [], policy)
    assert reason == GiveUp("rank 0 died; retry budget exhausted (--max-restarts=0, restarts=0)")


def test_a_missing_python_script_is_found_before_anything_starts(tmp_path: Path) -> None:
    """Relative paths: from workingDir, else from where trainguard run runs (friction: 4
    attempts burned on FileNotFoundError)."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.py").write_text("")
    check_scripts(plan_of(["python", "sub/t.py"]), "job.yaml", tmp_path)
    check_scripts(plan_of(["python", "t.py"], container={"workingDir": "sub"}), "j", tmp_path)
    check_scripts(plan_of(["python", "-m", "pkg"]), "job.yaml", tmp_path)  # not read
    check_scripts(plan_of(["bash", "-c", "python x.py"]), "job.yaml", tmp_path)
    with pytest.raises(SpecError) as info:
        check_scripts(plan_of(["python", "-u", "t.py"]), "job.yaml", tmp_path)
    assert str(info.value) == f"job.yaml: {CMD}: script t.py: not found (relative to {tmp_path})"
    with pytest.raises(SpecError) as info:
        check_scripts(plan_of(["torchrun", "sub"]), "job.yaml", tmp_path)
    assert "script sub: is a directory" in str(info.value)
    with pytest.raises(SpecError) as info:
        check_scripts(plan_of(["python", "t.py"], container={"workingDir": "nope"}), "j", tmp_path)
    assert ".containers[0].workingDir: " in str(info.value) and "no such directory" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("argv", "script"),
    [
        (["python", "t.py", "--x"], "t.py"),
        ([sys.executable, "-u", "-u", "/a/t.py"], "/a/t.py"),
        (["python3.11", "t.py"], "t.py"),
        (["python", "-m", "pkg"], None),
        (["python", "-X", "dev", "t.py"], None),
        (["python"], None),
        (["./run.sh", "t.py"], None),
        ([], None),
    ],
)
def test_python_script(argv: list[str], script: str | None) -> None:
    assert python_script(argv) == script


def test_launcher_module_and_no_python() -> None:
    plan = plan_of(["python", "-m", "torch.distributed.run", "-m", "pkg.train", "x"])
    assert plan.groups[0].command == (sys.executable, "-u", "-m", "pkg.train", "x")
    plan = plan_of(["hyperpodrun", "--no-python", "./run.sh", "x"])
    assert plan.groups[0].command == ("./run.sh", "x")


def test_launcher_agreeing_with_spec_is_fine() -> None:
    plan = plan_of(
        ["torchrun", "--nnodes=2", "--nproc_per_node=2", "t.py"],
        spec={"nprocPerNode": "2"},
        group={"replicas": 2},
    )
    assert (plan.nnodes, plan.nproc_per_node) == (2, 2)


def test_nproc_disagreement_names_the_spec_field() -> None:
    text = plan_error(["torchrun", "--nproc-per-node=2", "t.py"], spec={"nprocPerNode": 4})
    assert text == f"job.yaml: spec.nprocPerNode: 4 disagrees with --nproc-per-node=2 in {CMD}"


def test_nnodes_disagreement_names_replicas() -> None:
    text = plan_error(["torchrun", "--nnodes=2", "t.py"], group={"replicas": 3})
    assert text == (
        f"job.yaml: spec.replicaSpecs[0].replicas: 3 disagrees with --nnodes=2 in {CMD}"
    )


def test_max_restarts_disagreement_names_retry_count() -> None:
    text = plan_error(
        ["torchrun", "--max-restarts=1", "t.py"], spec={"runPolicy": {"jobMaxRetryCount": 2}}
    )
    assert text == (
        "job.yaml: spec.runPolicy.jobMaxRetryCount: 2 disagrees with --max-restarts=1 in " + CMD
    )


def test_two_groups_launchers_must_agree_with_each_other() -> None:
    container = {"name": "c", "command": ["torchrun", "--nproc-per-node=2", "t.py"]}
    other = {"name": "c", "command": ["torchrun", "--nproc-per-node=3", "t.py"]}
    data = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "j"},
        "spec": {
            "replicaSpecs": [
                {"name": "a", "template": {"spec": {"containers": [container]}}},
                {"name": "b", "template": {"spec": {"containers": [other]}}},
            ]
        },
    }
    with pytest.raises(SpecError) as info:
        resolve_plan(parse_job(data, "job.yaml"), "job.yaml")
    assert str(info.value) == (
        "job.yaml: spec.replicaSpecs[1].template.spec.containers[0].command: "
        f"--nproc-per-node=3 disagrees with --nproc-per-node=2 in {CMD}"
    )


def test_bad_launcher_line_names_the_command() -> None:
    text = plan_error(["torchrun", "--nnodes=1:2", "t.py"])
    assert text.startswith(f"job.yaml: {CMD}: --nnodes=1:2: MIN must equal MAX")


def test_empty_command_is_an_error() -> None:
    text = plan_error([])
    assert text.startswith(f"job.yaml: {CMD}: empty")


def test_value_from_is_not_supported_locally_but_for_secret_key_refs() -> None:
    env = [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"fieldRef": {}}}]
    text = plan_error(["python", "t.py"], container={"env": env})
    assert text == (
        "job.yaml: spec.replicaSpecs[0].template.spec.containers[0].env[1].valueFrom: "
        "not supported by the local platform (only secretKeyRef)"
    )  # secretKeyRef: tests/test_secrets.py


def test_env_from_is_not_supported_locally() -> None:
    text = plan_error(["python", "t.py"], container={"envFrom": [{"configMapRef": {}}]})
    assert text == (
        "job.yaml: spec.replicaSpecs[0].template.spec.containers[0].envFrom: "
        "not supported by the local platform"
    )


def test_kubernetes_variable_references_are_expanded() -> None:
    env = [{"name": "DIR", "value": "/data"}, {"name": "OUT", "value": "$(DIR)/out"}]
    plan = plan_of(
        ["python", "t.py", "--out=$(OUT)", "$(MISSING)", "$$(DIR)"], container={"env": env}
    )
    assert plan.groups[0].env == {"DIR": "/data", "OUT": "/data/out"}
    assert plan.groups[0].command[-3:] == ("--out=/data/out", "$(MISSING)", "$(DIR)")


def test_nproc_keywords_resolve_to_counts() -> None:
    assert plan_of(["python", "t.py"], spec={"nprocPerNode": "cpu"}).nproc_per_node == (
        os.cpu_count() or 1
    )


def test_gpu_needs_cuda_and_auto_falls_back_to_cpus() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices")
    text = plan_error(["python", "t.py"], spec={"nprocPerNode": "gpu"})
    assert text == "job.yaml: spec.nprocPerNode: gpu requested but no CUDA device found"
    plan = plan_of(["python", "t.py"], spec={"nprocPerNode": "auto"})
    assert plan.nproc_per_node == (os.cpu_count() or 1)


def test_plan_is_frozen() -> None:
    plan = plan_of(["python", "t.py"])
    with pytest.raises(AttributeError):
        plan.name = "x"  # type: ignore[misc]


# --- cli_job ---------------------------------------------------------------------------


def test_cli_job_builds_a_spec(tmp_path: Path) -> None:
    script = tmp_path / "My_Train.v2.py"
    script.write_text("print('hi')\n")
    built = cli_job(str(script), ["--lr", "1"], nnodes=2, nproc_per_node=3, max_restarts=1)
    assert built.metadata.name == "my-train-v2"
    plan = resolve_plan(built, "command line")
    assert (plan.nnodes, plan.nproc_per_node, plan.max_restarts) == (2, 3, 1)
    assert plan.groups[0].command == (sys.executable, "-u", str(script), "--lr", "1")


def test_cli_job_relative_script_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t.py").write_text("")
    monkeypatch.chdir(tmp_path)
    built = cli_job("t.py", [], nnodes=1, nproc_per_node="1", max_restarts=0, name="given")
    assert built.metadata.name == "given"
    command = built.spec.replica_specs[0].template.spec.containers[0].command
    assert command == [sys.executable, "-u", str(tmp_path / "t.py")]


def test_cli_job_module_and_no_python() -> None:
    built = cli_job("pkg.train", ["x"], nnodes=1, nproc_per_node=1, max_restarts=0, module=True)
    assert built.metadata.name == "train"
    command = built.spec.replica_specs[0].template.spec.containers[0].command
    assert command == [sys.executable, "-u", "-m", "pkg.train", "x"]
    built = cli_job("true", [], nnodes=1, nproc_per_node=1, max_restarts=0, no_python=True)
    assert built.spec.replica_specs[0].template.spec.containers[0].command == ["true"]


def test_cli_job_missing_script_names_the_file() -> None:
    with pytest.raises(SpecError) as info:
        cli_job("no_such_script.py", [], nnodes=1, nproc_per_node=1, max_restarts=0)
    assert str(info.value) == "command line: no_such_script.py: file not found"
    assert info.value.source == "command line"


def test_cli_job_bad_values_name_the_flags(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(SpecError) as info:
        cli_job(str(script), [], nnodes=0, nproc_per_node="many", max_restarts=-1, name="Bad")
    assert str(info.value).splitlines() == [
        "command line: --name: must be a lowercase DNS-1123 name: a-z, 0-9 and '-', "
        "starting and ending with a letter or digit, at most 63 characters",
        "command line: --nproc-per-node: must be auto, cpu, gpu or a positive integer",
        "command line: --nnodes: must be >= 1",
        "command line: --max-restarts: must be >= 0",
    ]


@pytest.mark.parametrize(
    ("text", "name"),
    [("train", "train"), ("My_Train.v2", "my-train-v2"), ("__", "job"), ("x" * 80, "x" * 63)],
)
def test_dns_name(text: str, name: str) -> None:
    assert dns_name(text) == name
