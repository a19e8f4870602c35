"""Every manifest trainguard generates is valid Kubernetes 1.31 (strict), and the Helm chart
renders the same objects as ``trainguard manifests``."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
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
from trainguard.kube.config import DEFAULT_IMAGE, OperatorConfig
from trainguard.kube.crd import crd
from trainguard.kube.manifests import operator_objects
from trainguard.kube.plan import kube_plan
from trainguard.kube.pods import headless_service, network_policy, node_pod, token_secret
from trainguard.kube.security import privileged_requests
from trainguard.spec import SpecError, load_job, parse_job

K8S_VERSION = "1.31"
CHART = REPO / "deploy" / "helm" / "trainguard"
JOBS = [
    REPO / "examples" / "gpt" / "job.yaml",
    REPO / "docs" / "examples" / "job-minimal.yaml",
    *sorted((REPO / "tests" / "data").glob("*.yaml")),
]


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
        "Role",
        "RoleBinding",
        "ClusterRole",  # node health labels: nodes are cluster-scoped
        "ClusterRoleBinding",
        "Role",  # the replicas' leader election, in the operator's namespace
        "RoleBinding",
        "Deployment",
        "Service",
    ]
    for doc in docs:
        validate(doc)
    # Strict means strict: an unknown field fails.
    broken = docs[9]
    broken["spec"]["replicaz"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def manifests(*flags: str) -> tuple[int, list[dict[str, Any]], str]:
    """``trainguard manifests FLAGS``: exit code, documents, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["manifests", *flags])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, [d for d in yaml.safe_load_all(out.getvalue()) if d], err.getvalue()


# The verbs the operator's calls need (kube/api.py and kopf's list/watch/patch), per
# resource: RBAC grants nothing beyond these.
OPERATOR_VERBS = {
    ("trainguard.dev", "trainingjobs"): {"list", "watch", "patch", "delete"},
    ("trainguard.dev", "trainingjobs/status"): {"patch"},
    ("", "pods"): {"list", "create", "delete"},
    ("", "services"): {"create", "delete"},
    ("", "secrets"): {"get", "create", "delete"},
    ("", "events"): {"create"},
    ("networking.k8s.io", "networkpolicies"): {"create", "delete"},
    ("kueue.x-k8s.io", "workloads"): {"get", "create", "delete"},
}


def granted(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames games
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rbac_is_namespaced_by_default_and_grants_only_what_the_operator_uses() -> None:
    code, docs, _ = manifests()
    assert code == 0
    # The one cluster-wide role: node health labels (Nodes are cluster-scoped) and what
    # the Nodes hold (the pods bound to them, listed).
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [r["metadata"]["name"] for r in cluster_roles] == ["trainguard-operator-nodes"]
    assert granted(cluster_roles[0]["rules"]) == {
        ("", "nodes"): {"get", "list", "patch"},
        ("", "pods"): {"list"},
    }
    cluster_binding = next(d for d in docs if d["kind"] == "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == "trainguard-operator-nodes"
    assert cluster_binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "trainguard-operator", "namespace": "trainguard-system"}
    ]
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "default"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "trainguard-operator",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "trainguard-operator", "namespace": "trainguard-system"}
    ]
    rights = granted(role["rules"])
    assert rights == OPERATOR_VERBS
    flat = [
        x for rule in role["rules"] for k in ("apiGroups", "resources", "verbs") for x in rule[k]
    ]
    assert "*" not in flat
    assert rights[("", "secrets")] == {"get", "create", "delete"}  # no list, watch, update
    # The operator watches only the namespaces it has rights in.
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["args"] == ["--namespace", "default", "--liveness-port", "8080"]


def test_rbac_scope_follows_the_install_flags() -> None:
    code, docs, _ = manifests("--job-namespace", "ml", "--job-namespace", "research")
    assert code == 0
    for doc in docs:
        validate(doc)
    roles = [(d["kind"], d["metadata"].get("namespace")) for d in docs if "Role" in d["kind"]]
    assert roles == [
        ("Role", "ml"),
        ("RoleBinding", "ml"),
        ("Role", "research"),
        ("RoleBinding", "research"),
        ("ClusterRole", None),  # nodes only: node health labels
        ("ClusterRoleBinding", None),
        ("Role", "trainguard-system"),  # leader election: Leases in its own namespace only
        ("RoleBinding", "trainguard-system"),
    ]
    leader = next(d for d in docs if d["metadata"]["name"] == "trainguard-operator-leader")
    assert granted(leader["rules"]) == {
        ("coordination.k8s.io", "leases"): {"get", "create", "update"}
    }
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--namespace", "ml", "--namespace", "research"]

    code, docs, _ = manifests("--all-namespaces", "--no-network-policies")
    assert code == 0
    for doc in docs:
        validate(doc)
    roles = [d["metadata"]["name"] for d in docs if d["kind"] in ("Role", "RoleBinding")]
    assert roles == ["trainguard-operator-leader"] * 2  # no job rights in a namespace
    cluster_role = next(
        d
        for d in docs
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "trainguard-operator"
    )
    assert "namespace" not in cluster_role["metadata"]
    expected = {k: v for k, v in OPERATOR_VERBS.items() if k[0] != "networking.k8s.io"}
    assert granted(cluster_role["rules"]) == expected
    binding = next(
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "trainguard-operator"
    )
    assert binding["roleRef"]["kind"] == "ClusterRole"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "--all-namespaces"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TRAINGUARD_NETWORK_POLICY"] == "false"
    assert env["TRAINGUARD_ALLOW_PRIVILEGED_PODS"] == "false"
    assert OperatorConfig.from_env(env).network_policy is False

    code, docs, _ = manifests("--allow-privileged-pods")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert OperatorConfig.from_env(env).allow_privileged_pods is True


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--job-namespace", "ml", "--all-namespaces"], "not allowed with argument"),
        (["--job-namespace", "Bad_NS"], "--job-namespace: 'Bad_NS' is not a namespace name"),
        (["--operator-namespace", "-x"], "expected one argument"),
    ],
)
def test_bad_install_flags_exit_2(flags: list[str], message: str) -> None:
    code, docs, err = manifests(*flags)
    assert code == 2 and not docs
    assert message in err, err


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


def test_crd_stores_workload_mode_and_an_integer_threshold_for_the_operator_to_judge() -> None:
    # The API server stores a HyperPod spec's runPolicy.workloadMode and an integer
    # metricThreshold; the operator then validates the spec, and refuses the mode.
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    run_policy = schema["properties"]["spec"]["properties"]["runPolicy"]
    assert run_policy["properties"]["workloadMode"]["type"] == "string"
    body = yaml.safe_load((REPO / "docs" / "examples" / "job-minimal.yaml").read_text())
    body["spec"]["runPolicy"] = {
        "workloadMode": "Deployment",
        "logMonitoringConfiguration": [
            {"name": "r", "logPattern": ".*x ([0-9]+)", "metricThreshold": 80, "operator": "lt"}
        ],
    }
    jsonschema.Draft4Validator(schema).validate(body)
    body["spec"]["runPolicy"]["workloadMode"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(body)


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
        "--backend",
        "gloo",
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
    health = "trainguard.dev/node-health-status"
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
    job = load_job(REPO / "docs" / "examples" / "job-minimal.yaml")
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
Node = tuple[Any, ...]


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
    nodes, end, stop = _parse(_tokens(text), 0)
    assert stop is None and end == len(_tokens(text)), "unbalanced if/range/else/end"
    return _evaluate(nodes, context, context)


def _tokens(text: str) -> list[tuple[str, str]]:
    """Literal text and actions, with ``{{-`` / ``-}}`` trimming applied."""
    tokens: list[tuple[str, str]] = []
    position, trim = 0, False
    for match in _ACTION.finditer(text):
        literal = text[position : match.start()]
        literal = literal.lstrip() if trim else literal
        tokens += [("text", literal.rstrip() if match.group(1) else literal)]
        tokens += [("action", match.group(2))]
        position, trim = match.end(), bool(match.group(3))
    rest = text[position:]
    return [*tokens, ("text", rest.lstrip() if trim else rest)]


def _parse(tokens: list[tuple[str, str]], index: int) -> tuple[list[Node], int, str | None]:
    """Nodes up to an ``else`` or ``end`` (returned as the stop word), or to the end."""
    nodes: list[Node] = []
    while index < len(tokens):
        kind, value = tokens[index]
        index += 1
        if kind == "text":
            nodes.append(("text", value))
        elif value in ("else", "end"):
            return nodes, index, value
        elif value.startswith(("if ", "range ")):
            word, _, expression = value.partition(" ")
            body, index, stop = _parse(tokens, index)
            other: list[Node] = []
            if stop == "else":
                other, index, stop = _parse(tokens, index)
            assert stop == "end", f"{value!r} has no end"
            nodes.append((word, expression, body, other))
        else:
            nodes.append(("output", value))
    return nodes, index, None


def _evaluate(nodes: list[Node], dot: Any, root: dict[str, Any]) -> str:
    out: list[str] = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "output":
            out.append(_go_text(_pipeline(node[1], dot, root)))
        elif node[0] == "if":
            chosen = node[2] if _pipeline(node[1], dot, root) else node[3]
            out.append(_evaluate(chosen, dot, root))
        else:  # range over a list; its else when the list is empty
            items = _pipeline(node[1], dot, root) or []
            out += [_evaluate(node[2], item, root) for item in items] or [
                _evaluate(node[3], dot, root)
            ]
    return "".join(out)


def _go_text(value: Any) -> str:
    """How Go's templates print a value (booleans in lower case)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _pipeline(text: str, dot: Any, root: dict[str, Any]) -> Any:
    stages = [s.split() for s in text.split("|")]
    value = _function(stages[0][0], stages[0][1:], None, dot, root)
    for stage in stages[1:]:
        value = _function(stage[0], stage[1:], value, dot, root)
    return value


def _function(name: str, args: list[str], piped: Any, dot: Any, root: dict[str, Any]) -> Any:
    if name == ".":
        return dot
    if name.startswith(("$.", ".")):
        value: Any = root if name.startswith("$") else dot
        for part in name.split(".")[1:]:
            value = value[part]
        return value
    if name == "quote":
        return '"' + _go_text(piped).replace('"', '\\"') + '"'
    if name == "toYaml":
        value = _function(args[0], [], None, dot, root)
        return yaml.safe_dump(value, sort_keys=False).rstrip()
    if name == "nindent":
        pad = " " * int(args[0])
        return "\n" + "\n".join(pad + line for line in str(piped).splitlines())
    raise AssertionError(f"template function {name!r} is outside the supported subset")


def _key(doc: dict[str, Any]) -> tuple[str, str, str]:
    meta = doc["metadata"]
    return doc["kind"], meta.get("namespace", ""), meta["name"]


def chart_objects(namespace: str, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_chart(CHART, namespace, values)) if d]


def test_helm_chart_renders_the_same_valid_objects() -> None:
    rendered = chart_objects("trainguard-system")
    for doc in rendered:
        validate(doc)
    expected = [o for o in operator_objects() if o["kind"] != "Namespace"]
    assert sorted(rendered, key=_key) == sorted(expected, key=_key)
    crds = [yaml.safe_load(p.read_text()) for p in (CHART / "crds").glob("*.yaml")]
    assert crds == [crd()], "regenerate crds/ as the chart's README says"


@pytest.mark.parametrize(
    ("values", "job_namespaces", "all_namespaces", "settings"),
    [
        ({"jobNamespaces": ["ml", "research"]}, ("ml", "research"), False, OperatorConfig()),
        ({"allNamespaces": True}, (), True, OperatorConfig()),
        (
            {
                "operator": {
                    **yaml.safe_load((CHART / "values.yaml").read_text())["operator"],
                    "allowPrivilegedPods": True,
                    "networkPolicy": False,
                }
            },
            ("default",),
            False,
            OperatorConfig(allow_privileged_pods=True, network_policy=False),
        ),
    ],
)
def test_helm_chart_values_match_the_install_flags(
    values: dict[str, Any],
    job_namespaces: tuple[str, ...],
    all_namespaces: bool,
    settings: OperatorConfig,
) -> None:
    """jobNamespaces / allNamespaces / operator.* render what --job-namespace /
    --all-namespaces / --allow-privileged-pods / --no-network-policies install."""
    rendered = chart_objects("ops", values)
    for doc in rendered:
        validate(doc)
    expected = operator_objects("ops", settings=settings, job_namespaces=job_namespaces,
                                all_namespaces=all_namespaces)  # fmt: skip
    expected = [o for o in expected if o["kind"] != "Namespace"]
    assert sorted(rendered, key=_key) == sorted(expected, key=_key)


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
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                assert main([verb, "--kubeconfig", kubeconfig, "--wait", "0"]) == 0
            lines = out.getvalue().splitlines()
            assert len(lines) == 10 and all(line.endswith(f" {word}") for line in lines), lines
            # The default image is named, with how to get it onto the cluster.
            assert f"the operator's image is {DEFAULT_IMAGE}" in err.getvalue()
            assert f"kind load docker-image {DEFAULT_IMAGE}" in err.getvalue()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["uninstall", "--kubeconfig", kubeconfig]) == 0
        assert out.getvalue().splitlines()[0] == "service/trainguard-operator-metrics deleted"
    finally:
        server.stop()


def test_the_default_image_is_what_the_dockerfile_builds() -> None:
    """`install` defaulted to an image that did not exist, and no Dockerfile built one."""
    import trainguard

    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert f"docker build -f deploy/Dockerfile -t {DEFAULT_IMAGE} ." in dockerfile
    assert f"trainguard:{trainguard.__version__}" == DEFAULT_IMAGE
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE):
        for path in source.split():
            assert (REPO / path).exists(), path
    values = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    assert f"{values['repository']}:{values['tag']}" == DEFAULT_IMAGE
    assert "../deploy/Dockerfile" in (REPO / "docs" / "kubernetes.md").read_text()


class _Pods:
    """The one call `install --wait` makes, answering with these pods in turn."""

    def __init__(self, *answers: list[dict[str, Any]]) -> None:
        self.answers = list(answers)

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        assert namespace == "trainguard-system" and selector
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _pod(**state: Any) -> dict[str, Any]:
    status = {"image": DEFAULT_IMAGE, "state": state}
    return {
        "metadata": {"name": "trainguard-operator-1"},
        "status": {"containerStatuses": [status]},
    }


def test_install_says_when_the_operator_image_cannot_be_pulled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(kube_cli, "FOLLOW_INTERVAL_SECONDS", 0.0)
    [deployment] = [o for o in operator_objects() if o["kind"] == "Deployment"]
    back_off = _pod(waiting={"reason": "ImagePullBackOff", "message": "not found"})
    pending = _pod(waiting={"reason": "ContainerCreating"})
    api: Any = _Pods([], [pending], [back_off])
    assert kube_cli._wait_for_operator(api, deployment, DEFAULT_IMAGE, 30.0) == 1
    err = capsys.readouterr().err
    assert f"ImagePullBackOff for {DEFAULT_IMAGE}: not found" in err
    assert "deploy/Dockerfile" in err and "--image REGISTRY/NAME:TAG" in err
    api = _Pods([pending], [_pod(running={"startedAt": "now"})])
    assert kube_cli._wait_for_operator(api, deployment, DEFAULT_IMAGE, 30.0) == 0
    assert capsys.readouterr().out == "deployment/trainguard-operator running\n"
    assert kube_cli._wait_for_operator(_Pods([pending]), deployment, DEFAULT_IMAGE, 0.01) == 0
    assert "not running after 0.01s" in capsys.readouterr().err
    assert kube_cli._wait_for_operator(_Pods([back_off]), deployment, DEFAULT_IMAGE, 0) == 0


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


# -- what a pod template may ask of the node ----------------------------------------------


def _job_body(**pod: Any) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "gpt" / "job.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0c3e9ad5-4bd3-4c1e-9a70-2b6c0d0d6b1e")
    body["spec"]["replicaSpecs"][0]["template"]["spec"].update(pod)
    return body


def _container(body: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = body["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    return container


def test_privileged_requests_name_every_field() -> None:
    pod = "spec.replicaSpecs[0].template.spec"
    body = _job_body(
        hostNetwork=True,
        hostPID=True,
        hostIPC=False,  # asking for nothing is fine
        volumes=[
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            {"name": "h", "hostPath": {"path": "/"}},
        ],
        initContainers=[{"name": "init", "securityContext": {"privileged": True}}],
        securityContext={"windowsOptions": {"hostProcess": True}},
    )
    _container(body)["securityContext"] = {
        "privileged": True,
        "allowPrivilegeEscalation": True,
        "capabilities": {"add": ["NET_BIND_SERVICE", "CAP_SYS_ADMIN", "IPC_LOCK"], "drop": ["ALL"]},
    }
    problems = dict(privileged_requests(body["spec"]))
    assert sorted(problems) == sorted(
        [
            f"{pod}.hostNetwork",
            f"{pod}.hostPID",
            f"{pod}.volumes[1].hostPath",
            f"{pod}.securityContext.windowsOptions.hostProcess",
            f"{pod}.initContainers[0].securityContext.privileged",
            f"{pod}.containers[0].securityContext.privileged",
            f"{pod}.containers[0].securityContext.allowPrivilegeEscalation",
            f"{pod}.containers[0].securityContext.capabilities.add[1]",
            f"{pod}.containers[0].securityContext.capabilities.add[2]",
        ]
    )
    assert "--allow-privileged-pods" in problems[f"{pod}.hostNetwork"]
    assert "CAP_SYS_ADMIN" in problems[f"{pod}.containers[0].securityContext.capabilities.add[1]"]
    # An ordinary training pod (memory /dev/shm, GPUs, a baseline capability, escalation off).
    fine = _job_body(volumes=[{"name": "shm", "emptyDir": {"medium": "Memory"}}])
    _container(fine)["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"add": ["CHOWN"]},
    }
    assert privileged_requests(fine["spec"]) == []
    # Garbage shapes are for the schema to refuse, not a crash here.
    assert (
        privileged_requests({"replicaSpecs": [{"template": {"spec": {"volumes": "x"}}}, 3]}) == []
    )


def test_privileged_templates_are_refused_unless_allowed(tmp_path: Path) -> None:
    body = _job_body()
    _container(body)["securityContext"] = {"privileged": True}
    where = "spec.replicaSpecs[0].template.spec.containers[0].securityContext.privileged"
    job = parse_job(body, "ml/gpt-demo")
    with pytest.raises(SpecError, match=re.escape(f"ml/gpt-demo: {where}: privileged mode")):
        kube_plan(job, "ml/gpt-demo")
    assert kube_plan(job, "ml/gpt-demo", allow_privileged=True).nnodes == 2
    # `trainguard submit` refuses it before it connects to a cluster (exit 2, the field).
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    err = io.StringIO()
    kubeconfig = str(tmp_path / "none")
    with contextlib.redirect_stderr(err):
        assert main(["submit", "-f", str(path), "--kubeconfig", kubeconfig]) == 2
    assert f"trainguard: {path}: {where}: privileged mode is refused" in err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # allowed: on to the (missing) kubeconfig
        code = main(
            ["submit", "-f", str(path), "--kubeconfig", kubeconfig, "--allow-privileged-pods"]
        )
    assert code == 2 and "cannot load the kubeconfig" in err.getvalue()


# -- secrets on Kubernetes ---------------------------------------------------------------


def test_env_values_and_secret_refs_go_to_the_pods_env_never_its_command() -> None:
    body = _job_body()
    container = _container(body)
    container["env"] = [
        {"name": "DATA_DIR", "value": "/data/plain-value-1234"},
        {
            "name": "WANDB_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "apiKey"}},
        },
        {"name": "OUT", "value": "$(DATA_DIR)/out"},
    ]
    container["args"] = ["--out", "$(OUT)", "--price", "5$$"]
    body["spec"]["checkpointing"] = {
        "durableUrl": "s3://bucket/ckpt",
        "storageOptions": {"key": "AKIAEXAMPLE", "secret": "s3cr3t-storage-value"},
    }
    job = parse_job(body, "ml/gpt-demo")
    plan = kube_plan(job, "ml/gpt-demo")
    assert plan.groups[0].env == {}
    pod = node_pod(job, body, 0, plan.groups[0], "node-1", "p", 3, OperatorConfig())
    validate(pod)
    pod_container = pod["spec"]["containers"][0]
    command = pod_container["command"]
    assert "args" not in pod_container
    text = json.dumps(command)
    for value in ("/data/plain-value-1234", "apiKey", "wandb", "s3cr3t", "AKIAEXAMPLE", "s3://"):
        assert value not in text
    assert "--env" not in command
    # Kubernetes expands $(OUT) in the pod; `$$` stays its escape of a literal `$`.
    assert command[-4:] == ["--out", "$(OUT)", "--price", "5$$"]
    env = {var["name"]: var for var in pod_container["env"]}
    assert env["DATA_DIR"] == {"name": "DATA_DIR", "value": "/data/plain-value-1234"}
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "apiKey"}}
    assert env["OUT"] == {"name": "OUT", "value": "$(DATA_DIR)/out"}
    # The agent's own settings (storage options among them) are one env variable, which
    # the agent takes out of its environment before starting workers.
    handed = json.loads(env["TRAINGUARD_JOB_ENV"]["value"].replace("$$", "$"))
    assert set(handed) == {
        "TRAINGUARD_JOB_DIR",
        "TRAINGUARD_CHECKPOINT_MEMORY_DIR",
        "TRAINGUARD_CHECKPOINT_CONFIG",
    }
    assert json.loads(handed["TRAINGUARD_CHECKPOINT_CONFIG"])["durableUrl"] == "s3://bucket/ckpt"
    assert (
        env["TRAINGUARD_AGENT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "gpt-demo-agent-token"
    )


def test_a_secret_in_the_command_is_refused_and_launcher_flags_are_written_out() -> None:
    body = _job_body()
    container = _container(body)
    container["env"] = [
        {"name": "HF", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "N", "value": "2"},
    ]
    container["args"] = ["--hf", "$(HF)"]
    with pytest.raises(SpecError, match=r"containers\[0\]\.args\[1\]: \$\(HF\) would put a secret"):
        kube_plan(parse_job(body, "x"), "x")
    container["args"] = []
    container["command"] = ["torchrun", "--nproc-per-node=$(N)", "train.py"]
    with pytest.raises(SpecError, match=r"write launcher flags out"):
        kube_plan(parse_job(body, "x"), "x")
    container["command"] = ["torchrun", "--nproc-per-node=2", "train.py", "--n=$(N)"]
    plan = kube_plan(parse_job(body, "x"), "x")
    assert plan.nproc_per_node == 2 and plan.groups[0].command[-1] == "--n=$(N)"


def test_env_value_from_needs_exactly_one_source() -> None:
    body = _job_body()
    for var, where in (
        ({"name": "A", "valueFrom": {}}, "env[0].valueFrom: needs exactly one of"),
        (
            {"name": "A", "value": "v", "valueFrom": {"fieldRef": {"fieldPath": "x"}}},
            "cannot be given with value",
        ),
        (
            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}},
            "secretKeyRef.key: field required",
        ),
    ):
        _container(body)["env"] = [var]
        with pytest.raises(SpecError, match=re.escape(where)):
            parse_job(body, "x")


# -- the job's NetworkPolicy --------------------------------------------------------------


def test_network_policy_lets_only_the_jobs_pods_and_the_operator_in() -> None:
    body = _job_body()
    job = parse_job(body, "ml/gpt-demo")
    settings = OperatorConfig(operator_namespace="tg-ops", agent_port=9000)
    policy = network_policy(job, body, settings)
    validate(policy)
    spec = policy["spec"]
    own = {"trainguard.dev/job": "gpt-demo", "app.kubernetes.io/managed-by": "trainguard"}
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    assert spec["podSelector"] == {"matchLabels": own}
    assert spec["policyTypes"] == ["Ingress"]
    peers, operator = spec["ingress"]
    # Each other, on any port: the rendezvous store, NCCL/Gloo, replica pushes.
    assert peers == {"from": [{"podSelector": {"matchLabels": own}}]}
    assert operator == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "tg-ops"}},
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/name": "trainguard",
                        "app.kubernetes.io/component": "operator",
                    }
                },
            }
        ],
        "ports": [{"protocol": "TCP", "port": 9000}],
    }
    # The job's pods carry the labels the policy selects.
    plan = kube_plan(job, "ml/gpt-demo")
    pod = node_pod(job, body, 0, plan.groups[0], "node-1", "p", 3, settings)
    assert own.items() <= pod["metadata"]["labels"].items()


def test_describe_on_a_cluster_shows_no_secret(capsys: pytest.CaptureFixture[str]) -> None:
    body = _job_body()
    _container(body)["env"] = [
        {"name": "HF_TOKEN", "value": "hf_plain_secret_value"},
        {"name": "DATA", "value": "/data"},
    ]
    body["spec"]["checkpointing"] = {"storageOptions": {"secret": "s3cr3t-storage-value"}}

    class Api:
        def get_job(self, namespace: str, name: str) -> dict[str, Any]:
            return body

        def list_events(self, namespace: str, name: str) -> list[dict[str, Any]]:
            return []

    args = argparse.Namespace(job="gpt-demo", output="json")
    assert kube_cli._describe(Api(), args, "ml") == 0  # type: ignore[arg-type]
    shown = capsys.readouterr().out
    assert "hf_plain_secret_value" not in shown and "s3cr3t" not in shown
    assert json.loads(shown)["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["env"][
        1
    ] == {"name": "DATA", "value": "/data"}
