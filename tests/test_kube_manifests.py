"""Every manifest trainguard generates is valid Kubernetes 1.31 (strict), and the Helm chart
renders the same objects as ``trainguard manifests``."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from trainguard.cli import main
from trainguard.kube import cli as kube_cli
from trainguard.kube.config import OperatorConfig
from trainguard.kube.crd import crd
from trainguard.kube.manifests import operator_objects
from trainguard.kube.plan import kube_plan
from trainguard.kube.pods import headless_service, node_pod, token_secret
from trainguard.spec import SpecError, load_job, parse_job

K8S_VERSION = "1.31"
CHART = REPO / "deploy" / "helm" / "trainguard"
JOBS = [REPO / "examples" / "gpt" / "job.yaml", *sorted((REPO / "tests" / "data").glob("*.yaml"))]


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def cli_manifests() -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["manifests"]) == 0
    return [d for d in yaml.safe_load_all(out.getvalue()) if d]


def test_manifests_are_valid_kubernetes() -> None:
    docs = cli_manifests()
    kinds = [d["kind"] for d in docs]
    assert kinds == [
        "CustomResourceDefinition",
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
    ]
    for doc in docs:
        validate(doc)
    # Strict means strict: an unknown field fails.
    broken = docs[5]
    broken["spec"]["replicaz"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_crd_has_status_subresource_and_printer_columns() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Phase": ".status.phase",
        "Restarts": ".status.restartCount",
        "Age": ".metadata.creationTimestamp",
    }


def _structural_problems(node: Any, where: str) -> list[str]:
    """The structural-schema rules that JSON Schema generators break (apiextensions v1)."""
    problems: list[str] = []
    if not isinstance(node, dict):
        return problems
    for key in ("$ref", "$defs", "const", "title", "default", "nullable"):
        if key in node:
            problems.append(f"{where}: {key}")
    if node.get("additionalProperties") is False:
        problems.append(f"{where}: additionalProperties false")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{where}: properties with additionalProperties")
    special = node.get("x-kubernetes-int-or-string") or node.get(
        "x-kubernetes-preserve-unknown-fields"
    )
    if "type" not in node and not special:
        problems.append(f"{where}: no type")
    for branch in node.get("anyOf") or []:
        if "type" in branch and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{where}: type inside anyOf")
    for name, sub in (node.get("properties") or {}).items():
        problems += _structural_problems(sub, f"{where}.{name}")
    if isinstance(node.get("items"), dict):
        problems += _structural_problems(node["items"], f"{where}[]")
    if isinstance(node.get("additionalProperties"), dict):
        problems += _structural_problems(node["additionalProperties"], f"{where}{{}}")
    return problems


def test_crd_schema_is_structural_and_accepts_every_example_job() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _structural_problems(schema, "") == []
    # OpenAPI v3.0 schemas read as JSON Schema draft 4 (boolean exclusiveMinimum): real
    # jobs pass, a job without nodes does not.
    validator = jsonschema.Draft4Validator(schema)
    assert len(JOBS) >= 3
    for path in JOBS:
        body = yaml.safe_load(path.read_text())
        body["apiVersion"], body["kind"] = "trainguard.dev/v1", "TrainingJob"
        validator.validate(body)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"spec": {"replicaSpecs": []}})


def test_job_pods_service_and_secret_are_valid_kubernetes() -> None:
    path = REPO / "examples" / "gpt" / "job.yaml"
    body = yaml.safe_load(path.read_text())
    body["metadata"].update(namespace="ml", uid="0c3e9ad5-4bd3-4c1e-9a70-2b6c0d0d6b1e")
    job = parse_job(body, str(path))
    plan = kube_plan(job, str(path))
    settings = OperatorConfig()
    pod = node_pod(job, body, 0, plan.groups[0], "node-1", "p", 3, settings, ["bad-host"])
    for obj in (pod, headless_service(job, body, settings), token_secret(job, body, "t0k")):
        validate(obj)
    container = pod["spec"]["containers"][0]
    split = container["command"].index("--")
    assert container["command"][:3] == ["python", "-m", "trainguard.agent"]
    assert container["command"][split + 1 :] == [
        "python",
        "-u",
        "examples/gpt/train.py",
        "--steps",
        "400",
        "--ckpt-every",
        "20",
        "--log-every",
        "1",
    ]
    assert "args" not in container
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    health = settings.node_health_label
    assert [t["matchExpressions"] for t in terms] == [
        [
            {"key": health, "operator": "DoesNotExist"},
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["bad-host"]},
        ],
        [
            {"key": health, "operator": "In", "values": ["Schedulable"]},
            {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["bad-host"]},
        ],
    ]


def test_symbolic_nproc_needs_a_number_or_a_gpu_limit_on_kubernetes() -> None:
    job = load_job(REPO / "tests" / "data" / "spec_minimal.yaml")
    data = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["spec"]["nprocPerNode"] = "cpu"
    with pytest.raises(SpecError, match=r"spec\.nprocPerNode"):
        kube_plan(parse_job(data, "x.yaml"), "x.yaml")
    data["spec"]["nprocPerNode"] = "gpu"
    container = data["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    assert kube_plan(parse_job(data, "x.yaml"), "x.yaml").nproc_per_node == 8


def test_operator_settings_from_environment_name_a_bad_variable() -> None:
    settings = OperatorConfig.from_env(
        {"TRAINGUARD_AGENT_PORT": "9000", "TRAINGUARD_NODE_HEALTHY_VALUES": "Schedulable,Ok"}
    )
    assert settings.agent_port == 9000
    assert settings.node_healthy_values == ("Schedulable", "Ok")
    assert OperatorConfig.from_env(settings.to_env()) == settings
    with pytest.raises(ValueError, match="TRAINGUARD_AGENT_PORT"):
        OperatorConfig.from_env({"TRAINGUARD_AGENT_PORT": "many"})


# -- the Helm chart ---------------------------------------------------------------------

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)


def render_chart(chart: Path, namespace: str, values: dict[str, Any] | None = None) -> str:
    """Render every template with the subset of Helm's language the chart's README lists."""
    chart_meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    context = {
        "Values": {**yaml.safe_load((chart / "values.yaml").read_text()), **(values or {})},
        "Release": {"Namespace": namespace, "Name": "trainguard"},
        "Chart": {"AppVersion": chart_meta["appVersion"], "Name": chart_meta["name"]},
    }
    docs = [_render(p.read_text(), context) for p in sorted((chart / "templates").glob("*.yaml"))]
    return "\n---\n".join(docs)


def _render(text: str, context: dict[str, Any]) -> str:
    out: list[str] = []
    emitting = [True]
    position = 0
    for match in _ACTION.finditer(text):
        literal = text[position : match.start()]
        if match.group(1):
            literal = literal.rstrip()
        if all(emitting):
            out.append(literal)
        position = match.end()
        if match.group(3):
            rest = text[position:]
            position += len(rest) - len(rest.lstrip())
        action = match.group(2)
        if action.startswith("if "):
            emitting.append(bool(_pipeline(action[3:], context)))
        elif action == "end":
            emitting.pop()
        elif all(emitting):
            out.append(str(_pipeline(action, context)))
    out.append(text[position:])
    assert len(emitting) == 1, "unbalanced if/end"
    return "".join(out)


def _pipeline(text: str, context: dict[str, Any]) -> Any:
    stages = [s.split() for s in text.split("|")]
    value = _function(stages[0][0], stages[0][1:], None, context)
    for stage in stages[1:]:
        value = _function(stage[0], stage[1:], value, context)
    return value


def _function(name: str, args: list[str], piped: Any, context: dict[str, Any]) -> Any:
    if name.startswith("."):
        value: Any = context
        for part in name[1:].split("."):
            value = value[part]
        return value
    if name == "quote":
        return '"' + str(piped).replace('"', '\\"') + '"'
    if name == "toYaml":
        return yaml.safe_dump(_function(args[0], [], None, context), sort_keys=False).rstrip()
    if name == "nindent":
        pad = " " * int(args[0])
        return "\n" + "\n".join(pad + line for line in str(piped).splitlines())
    raise AssertionError(f"template function {name!r} is outside the supported subset")


def test_helm_chart_renders_the_same_valid_objects() -> None:
    rendered = [d for d in yaml.safe_load_all(render_chart(CHART, "trainguard-system")) if d]
    for doc in rendered:
        validate(doc)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    expected = [o for o in operator_objects() if o["kind"] != "Namespace"]
    assert sorted(rendered, key=key) == sorted(expected, key=key)
    crds = [yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml")]
    assert crds == [crd()], "regenerate crds/ as the chart's README says"


def test_helm_chart_values_change_the_output() -> None:
    values = {"image": {"repository": "registry.local/tg", "tag": "1.2"}, "resources": {}}
    rendered = [d for d in yaml.safe_load_all(render_chart(CHART, "ml-ops", values)) if d]
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.local/tg:1.2"
    assert "resources" not in container
    assert deployment["metadata"]["namespace"] == "ml-ops"
    for doc in rendered:
        validate(doc)


def test_install_and_uninstall_apply_every_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kube_harness import ApiServer

    # kmock cannot serve /api/v1/namespaces (its path parser needs a namespace name).
    everything = kube_cli.all_objects
    monkeypatch.setattr(
        kube_cli,
        "all_objects",
        lambda *a: [o for o in everything(*a) if o["kind"] != "Namespace"],
    )
    server = ApiServer()
    try:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        for verb, word in (("install", "created"), ("install", "configured")):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main([verb, "--kubeconfig", kubeconfig]) == 0
            lines = out.getvalue().splitlines()
            assert len(lines) == 6 and all(line.endswith(f" {word}") for line in lines), lines
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["uninstall", "--kubeconfig", kubeconfig]) == 0
        assert out.getvalue().splitlines()[0] == "service/trainguard-operator-metrics deleted"
    finally:
        server.stop()


def test_pods_carry_the_jobs_worker_start_options() -> None:
    path = REPO / "examples" / "gpt" / "job.yaml"
    body = yaml.safe_load(path.read_text())
    body["metadata"].update(namespace="ml", uid="0c3e9ad5-4bd3-4c1e-9a70-2b6c0d0d6b1e")
    body["spec"]["trainguard"] = {"warmStart": False, "preloadModules": ["transformers"]}
    job = parse_job(body, str(path))
    plan = kube_plan(job, str(path))
    pod = node_pod(job, body, 0, plan.groups[0], "node-1", "p", 3, OperatorConfig())
    command = pod["spec"]["containers"][0]["command"]
    agent_args = command[: command.index("--")]
    assert agent_args[-3:] == ["--cold-start", "--preload", "transformers"]
