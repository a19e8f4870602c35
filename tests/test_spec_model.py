"""TrainingJob validation: valid specs, and one exact error line per kind of mistake."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import SpecError, TrainingJob, json_schema, load_job, parse_job

DATA = Path(__file__).parent / "data"
STARTING_SPEC = Path(__file__).parent.parent / "docs" / "examples" / "job-minimal.yaml"

MINIMAL: dict[str, Any] = {
    "apiVersion": "trainguard.dev/v1",
    "kind": "TrainingJob",
    "metadata": {"name": "tiny"},
    "spec": {
        "replicaSpecs": [
            {
                "name": "worker",
                "template": {
                    "spec": {"containers": [{"name": "c", "command": ["python", "t.py"]}]}
                },
            }
        ]
    },
}


def job_with(**changes: Any) -> dict[str, Any]:
    """MINIMAL with dotted-path changes, e.g. job_with(**{"spec.nprocPerNode": 2})."""
    data = copy.deepcopy(MINIMAL)
    for dotted, value in changes.items():
        node: Any = data
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[last] = value
    return data


def errors_of(data: object) -> str:
    with pytest.raises(SpecError) as info:
        parse_job(data, "job.yaml")
    return str(info.value)


def test_minimal_job_gets_defaults() -> None:
    job = parse_job(MINIMAL, "job.yaml")
    assert job.metadata.name == "tiny"
    assert job.metadata.namespace == "default"
    assert job.spec.nproc_per_node is None
    group = job.spec.replica_specs[0]
    assert (group.replicas, group.spares, group.max_replicas) == (1, 0, None)
    assert job.spec.run_policy.job_max_retry_count is None
    assert job.spec.run_policy.clean_pod_policy == "All"
    assert job.spec.run_policy.log_monitoring_configuration == []
    assert job.spec.trainguard.stop_grace_period_seconds == 10
    assert job.spec.trainguard.poll_interval_seconds == 0.5
    assert job.spec.trainguard.node_start_timeout_seconds == 60


def test_example_file_parses_with_log_rules() -> None:
    job = load_job(DATA / "spec_example.yaml")
    assert job.spec.nproc_per_node == "2"
    assert job.spec.replica_specs[0].replicas == 2
    rules = {rule.name: rule for rule in job.spec.run_policy.log_monitoring_configuration}
    assert rules["JobStart"].expected_start_cut_off_in_seconds == 120
    assert rules["JobHangingDetection"].expected_recurring_frequency_in_seconds == 30
    slow = rules["LowThroughput"]
    assert (slow.metric_threshold, slow.operator, slow.metric_evaluation_data_points) == (
        80,
        "lteq",
        5,
    )
    assert rules["NanLoss"].fault_on_match
    assert rules["JobStart"].metric_evaluation_data_points == 1
    restart = job.spec.run_policy.restart_policy
    assert restart is not None and restart.eval_period_seconds == 600
    assert job.spec.trainguard.stop_grace_period_seconds == 5


def test_minimal_example_file_parses() -> None:
    job = load_job(STARTING_SPEC)
    assert job.metadata.name == "minimal"
    assert job.spec.replica_specs[0].replicas == 2


@pytest.mark.parametrize(
    ("given", "stored"), [(4, "4"), ("8", "8"), ("auto", "auto"), ("cpu", "cpu"), ("gpu", "gpu")]
)
def test_nproc_per_node_accepts_int_numeric_string_and_keywords(given: object, stored: str) -> None:
    job = parse_job(job_with(**{"spec.nprocPerNode": given}), "job.yaml")
    assert job.spec.nproc_per_node == stored


@pytest.mark.parametrize("bad", [0, "0", "xpu", -2, True, "two"])
def test_nproc_per_node_rejects_other_values(bad: object) -> None:
    assert errors_of(job_with(**{"spec.nprocPerNode": bad})) == (
        "job.yaml: spec.nprocPerNode: must be auto, cpu, gpu or a positive integer"
    )


def test_bad_field_gives_exact_error_line() -> None:
    data = job_with(**{"spec.replicaSpecs.0.replicas": 0})
    assert errors_of(data) == "job.yaml: spec.replicaSpecs[0].replicas: must be >= 1"


def test_several_problems_one_line_each() -> None:
    data = job_with(**{"spec.replicaSpecs.0.spares": -1, "spec.runPolicy.jobMaxRetryCount": "x"})
    del data["metadata"]["name"]
    assert errors_of(data).splitlines() == [
        "job.yaml: metadata.name: field required",
        "job.yaml: spec.replicaSpecs[0].spares: must be >= 0",
        "job.yaml: spec.runPolicy.jobMaxRetryCount: must be an integer",
    ]


def test_bounds_and_types_read_naturally() -> None:
    data = job_with(**{"spec.trainguard": {"pollIntervalSeconds": 0}, "spec.runPolicy": 3})
    assert errors_of(data).splitlines() == [
        "job.yaml: spec.runPolicy: must be a mapping",
        "job.yaml: spec.trainguard.pollIntervalSeconds: must be > 0",
    ]
    data = job_with(**{"spec.replicaSpecs.0.template.spec.containers.0.command": "python t.py"})
    assert errors_of(data) == (
        "job.yaml: spec.replicaSpecs[0].template.spec.containers[0].command: must be a list"
    )


def test_unknown_field_is_an_error_naming_it_and_the_nearest_known_one() -> None:
    data = job_with(**{"spec.runPolicy.jobMaxRetryCuont": 3})
    assert errors_of(data) == (
        "job.yaml: spec.runPolicy.jobMaxRetryCuont: unknown field; did you mean jobMaxRetryCount?"
    )
    data = job_with(**{"spec.replicaSpecs.0.replica": 3})
    assert errors_of(data) == (
        "job.yaml: spec.replicaSpecs[0].replica: unknown field; did you mean replicas?"
    )
    assert errors_of(job_with(**{"metadata.lables": {}})) == (
        "job.yaml: metadata.lables: unknown field; did you mean labels?"
    )
    # The friction report's own: a letter short, a case slip, nested under a list.
    assert errors_of(job_with(**{"spec.nprocPerNod": 2})) == (
        "job.yaml: spec.nprocPerNod: unknown field; did you mean nprocPerNode?"
    )
    assert errors_of(job_with(**{"spec.trainguard.warmstart": False})).endswith(
        "did you mean warmStart?"
    )
    data = job_with(
        **{"spec.runPolicy.restartPolicy": {"evalPeriodSeconds": 60, "maxFullJobRestart": 1}}
    )
    assert errors_of(data) == (
        "job.yaml: spec.runPolicy.restartPolicy.maxFullJobRestart: unknown field; "
        "did you mean maxFullJobRestarts?"
    )
    # Nothing close: no guess.
    assert errors_of(job_with(**{"spec.colour": "blue"})) == "job.yaml: spec.colour: unknown field"


def test_pod_template_keeps_unknown_kubernetes_fields() -> None:
    data = job_with(**{"spec.replicaSpecs.0.template.spec.nodeSelector": {"a": "b"}})
    data["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": 8080}
    ]
    job = parse_job(data, "job.yaml")
    dumped = job.model_dump(by_alias=True, exclude_none=True)
    pod = dumped["spec"]["replicaSpecs"][0]["template"]["spec"]
    assert pod["nodeSelector"] == {"a": "b"}
    assert pod["containers"][0]["ports"] == [{"containerPort": 8080}]


def test_kubernetes_metadata_fields_are_accepted() -> None:
    data = job_with(**{"metadata.uid": "1234", "metadata.resourceVersion": "7"})
    assert parse_job(data, "job.yaml").metadata.name == "tiny"


@pytest.mark.parametrize("name", ["Upper", "has_underscore", "-dash", "a" * 64, ""])
def test_job_name_must_be_dns_label(name: str) -> None:
    assert errors_of(job_with(**{"metadata.name": name})).startswith(
        "job.yaml: metadata.name: must be a lowercase DNS-1123 name"
    )


def test_needs_a_replica_spec_and_a_container() -> None:
    assert errors_of(job_with(**{"spec.replicaSpecs": []})) == (
        "job.yaml: spec.replicaSpecs: must have at least 1 item(s)"
    )
    data = job_with(**{"spec.replicaSpecs.0.template.spec.containers": []})
    assert errors_of(data) == (
        "job.yaml: spec.replicaSpecs[0].template.spec.containers: must have at least 1 item(s)"
    )


def test_env_value_must_be_a_string() -> None:
    data = job_with(
        **{"spec.replicaSpecs.0.template.spec.containers.0.env": [{"name": "A", "value": 1}]}
    )
    assert errors_of(data) == (
        "job.yaml: spec.replicaSpecs[0].template.spec.containers[0].env[0].value: "
        "must be a string (quote it in YAML)"
    )


def test_invalid_regex_names_the_field() -> None:
    rules = [{"name": "r", "logPattern": ".*Loss: (["}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert text.startswith(
        "job.yaml: spec.runPolicy.logMonitoringConfiguration[0].logPattern: "
        "invalid regular expression:"
    )
    rules = [{"name": "r", "logPattern": ".*", "stopPattern": "("}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert "logMonitoringConfiguration[0].stopPattern: invalid regular expression" in text


def test_operator_and_threshold_go_together() -> None:
    path = "job.yaml: spec.runPolicy.logMonitoringConfiguration[0]"
    rules: list[dict[str, Any]] = [{"name": "r", "logPattern": ".*x ([0-9]+)", "operator": "gt"}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert text == f"{path}.metricThreshold: required when operator is set"
    rules = [{"name": "r", "logPattern": ".*x ([0-9]+)", "metricThreshold": 3}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert text == f"{path}.operator: required when metricThreshold is set"
    rules = [{"name": "r", "logPattern": ".*x", "metricThreshold": 3, "operator": "gt"}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert (
        text
        == f"{path}.logPattern: needs a capture group for the metric when metricThreshold is set"
    )


def test_operator_must_be_known() -> None:
    rules = [{"name": "r", "logPattern": "(.*)", "metricThreshold": 1, "operator": ">="}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert text == (
        "job.yaml: spec.runPolicy.logMonitoringConfiguration[0].operator: "
        "must be one of: gt, lt, eq, gteq, lteq"
    )


def test_duplicate_rule_names_rejected() -> None:
    rules = [{"name": "r", "logPattern": ".*"}, {"name": "r", "logPattern": ".*"}]
    text = errors_of(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}))
    assert text == "job.yaml: spec.runPolicy.logMonitoringConfiguration: duplicate rule name 'r'"


def test_clean_pod_policy_enum() -> None:
    text = errors_of(job_with(**{"spec.runPolicy.cleanPodPolicy": "Some"}))
    assert (
        text == "job.yaml: spec.runPolicy.cleanPodPolicy: must be one of: All, OnlyComplete, None"
    )


def test_restart_policy_needs_eval_period() -> None:
    text = errors_of(job_with(**{"spec.runPolicy.restartPolicy": {"maxFullJobRestarts": 1}}))
    assert text == "job.yaml: spec.runPolicy.restartPolicy.evalPeriodSeconds: field required"


def test_elastic_policy_step_and_values_are_exclusive() -> None:
    elastic: dict[str, Any] = {"minReplicas": 1, "maxReplicas": 4, "replicaIncrementStep": 1}
    job = parse_job(job_with(**{"spec.elasticPolicy": elastic}), "job.yaml")
    assert job.spec.elastic_policy is not None
    assert job.spec.elastic_policy.replica_increment_step == 1
    elastic["replicaDiscreteValues"] = [2, 4]
    assert errors_of(job_with(**{"spec.elasticPolicy": elastic})) == (
        "job.yaml: spec.elasticPolicy.replicaDiscreteValues: "
        "mutually exclusive with replicaIncrementStep"
    )


def test_elastic_policy_min_not_above_max() -> None:
    text = errors_of(job_with(**{"spec.elasticPolicy": {"minReplicas": 3, "maxReplicas": 2}}))
    assert text == "job.yaml: spec.elasticPolicy.minReplicas: must be <= maxReplicas (2)"


def test_max_replicas_not_below_replicas() -> None:
    data = job_with(**{"spec.replicaSpecs.0.replicas": 3, "spec.replicaSpecs.0.maxReplicas": 2})
    assert errors_of(data) == "job.yaml: spec.replicaSpecs[0].maxReplicas: must be >= replicas (3)"


def test_python_names_and_camel_case_both_work() -> None:
    job = parse_job(job_with(**{"spec.nproc_per_node": 3}), "job.yaml")
    assert job.spec.nproc_per_node == "3"
    again = TrainingJob.model_validate(job.model_dump(by_alias=True))
    assert again == job


def test_schema_uses_camel_case_names_and_has_no_nulls() -> None:
    schema = json_schema()
    defs = schema["$defs"]
    assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec"}
    assert {
        "nprocPerNode",
        "replicaSpecs",
        "runPolicy",
        "elasticPolicy",
        "trainguard",
        "checkpointing",
    } == set(defs["TrainingJobSpec"]["properties"])
    assert "jobMaxRetryCount" in defs["RunPolicy"]["properties"]
    assert "logMonitoringConfiguration" in defs["RunPolicy"]["properties"]
    assert "expectedStartCutOffInSeconds" in defs["LogRule"]["properties"]
    assert "stopGracePeriodSeconds" in defs["TrainguardOptions"]["properties"]
    assert "workingDir" in defs["Container"]["properties"]
    assert defs["TrainingJobSpec"]["additionalProperties"] is False
    assert defs["PodSpec"]["additionalProperties"] is True
    assert '"null"' not in str(schema).replace("'", '"')
    for name, model in defs.items():
        for field, prop in model.get("properties", {}).items():
            assert prop.get("description"), f"{name}.{field} has no description"


def test_warm_start_options_and_module_names() -> None:
    job = parse_job(MINIMAL, "job.yaml")
    assert job.spec.trainguard.warm_start is True and job.spec.trainguard.preload_modules == []
    cold = job_with(**{"spec.trainguard": {"warmStart": False, "preloadModules": ["a.b", "c"]}})
    options = parse_job(cold, "job.yaml").spec.trainguard
    assert options.warm_start is False and options.preload_modules == ["a.b", "c"]
    bad = job_with(**{"spec.trainguard.preloadModules": ["ok", "not a module"]})
    assert errors_of(bad).startswith("job.yaml: spec.trainguard.preloadModules[1]: ")


def test_straggler_options_defaults_and_bad_values() -> None:
    options = parse_job(MINIMAL, "job.yaml").spec.trainguard
    assert (options.straggler_threshold, options.straggler_window) == (1.3, 20)
    assert options.straggler_action == "report"
    given = {"stragglerThreshold": 2, "stragglerWindow": 50, "stragglerAction": "restart"}
    options = parse_job(job_with(**{"spec.trainguard": given}), "job.yaml").spec.trainguard
    assert (options.straggler_threshold, options.straggler_window) == (2.0, 50)
    assert options.straggler_action == "restart"
    off = job_with(**{"spec.trainguard.stragglerThreshold": None})
    assert parse_job(off, "job.yaml").spec.trainguard.straggler_threshold is None
    field = "job.yaml: spec.trainguard."
    for key, bad, message in [
        ("stragglerThreshold", 1, "must be > 1"),
        ("stragglerThreshold", float("inf"), "must be a finite number"),
        ("stragglerThreshold", float("nan"), "must be a finite number"),
        ("stragglerThreshold", "fast", "must be a number"),
        ("stragglerWindow", 1, "must be >= 2"),
        ("stragglerWindow", 10_001, "must be <= 10000"),
        ("stragglerWindow", 2.5, "must be an integer"),
        ("stragglerAction", "kill", "must be one of: report, restart"),
    ]:
        data = job_with(**{f"spec.trainguard.{key}": bad})
        assert errors_of(data) == f"{field}{key}: {message}"


def test_workload_mode_is_refused_naming_the_field_and_null_is_no_mode() -> None:
    # HyperPod's runPolicy.workloadMode: no value is known to trainguard, so none is run
    # (trainguard.spec.model.WORKLOAD_MODES); the field is not "unknown" either.
    for kind in ("trainguard", "hyperpod"):
        data = job_with(**{"spec.runPolicy.workloadMode": "Deployment"})
        if kind == "hyperpod":
            data["apiVersion"], data["kind"] = "sagemaker.amazonaws.com/v1", "HyperPodPyTorchJob"
        assert errors_of(data) == (
            "job.yaml: spec.runPolicy.workloadMode: 'Deployment' is not a workload mode "
            "trainguard runs (it runs none of HyperPod's yet); remove the field"
        )
    assert errors_of(job_with(**{"spec.runPolicy.workloadMode": 1})) == (
        "job.yaml: spec.runPolicy.workloadMode: must be a string (quote it in YAML)"
    )
    job = parse_job(job_with(**{"spec.runPolicy.workloadMode": None}), "job.yaml")
    assert job.spec.run_policy.workload_mode is None
    schema = json_schema()["$defs"]["RunPolicy"]["properties"]["workloadMode"]
    assert schema["type"] == "string"


def test_metric_threshold_as_hyperpods_integer_means_the_same_as_the_number() -> None:
    from trainguard.monitor.rules import LogRuleSpec

    def rule(threshold: object) -> LogRuleSpec:
        rules = [
            {
                "name": "r",
                "logPattern": ".*x ([0-9.]+)",
                "metricThreshold": threshold,
                "operator": "eq",
            }
        ]
        job = parse_job(job_with(**{"spec.runPolicy.logMonitoringConfiguration": rules}), "j")
        return LogRuleSpec.from_model(job.spec.run_policy.log_monitoring_configuration[0])

    whole, number = rule(80), rule(80.0)
    assert whole == number and whole.to_json() == number.to_json()
    assert whole.is_bad(80) and whole.is_bad(80.0) and not whole.is_bad(80.5)
    assert rule(-3).metric_threshold == -3
    schema = json_schema()["$defs"]["LogRule"]["properties"]["metricThreshold"]
    assert schema["type"] == "number"  # JSON Schema and OpenAPI: integers are numbers
    text = errors_of(
        job_with(
            **{
                "spec.runPolicy.logMonitoringConfiguration": [
                    {"name": "r", "logPattern": "(.*)", "metricThreshold": "many", "operator": "gt"}
                ]
            }
        )
    )
    assert text.endswith("logMonitoringConfiguration[0].metricThreshold: must be a number")
