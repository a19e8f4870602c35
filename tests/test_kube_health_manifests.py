"""Node health in the manifests: the operator's ClusterRole on nodes, the health agent's
DaemonSet (valid Kubernetes 1.31, strict; least privilege; no hostPath; non-root unless
the kernel log is asked for), the install flags, and the Helm chart rendering the same."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from test_kube_manifests import CHART, _key, chart_objects, granted, manifests, validate
from trainguard.cli import main
from trainguard.kube import cli as kube_cli
from trainguard.kube.config import OperatorConfig
from trainguard.kube.health_manifests import HealthAgentOptions
from trainguard.kube.manifests import operator_objects

Obj = dict[str, Any]
AGENT = "trainguard-health-agent"


def named(docs: list[Obj], kind: str, name: str) -> Obj:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def env_of(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_health_agent_is_a_least_privilege_daemonset() -> None:
    code, docs, _ = manifests("--health-agent")
    assert code == 0
    for doc in docs:
        validate(doc)
    assert [(d["kind"], d["metadata"]["name"]) for d in docs][-4:] == [
        ("ServiceAccount", AGENT),
        ("ClusterRole", AGENT),
        ("ClusterRoleBinding", AGENT),
        ("DaemonSet", AGENT),
    ]
    assert granted(named(docs, "ClusterRole", AGENT)["rules"]) == {("", "nodes"): {"get", "patch"}}
    binding = named(docs, "ClusterRoleBinding", AGENT)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": AGENT, "namespace": "trainguard-system"}
    ]
    daemonset = named(docs, "DaemonSet", AGENT)
    assert daemonset["metadata"]["namespace"] == "trainguard-system"
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == AGENT
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532}
    assert pod["tolerations"] == [{"operator": "Exists"}]  # every Node, the unhealthy too
    assert all("hostPath" not in v for v in pod["volumes"])
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "trainguard.kube.health_agent"]
    assert "--kmsg" not in container["args"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert env_of(container) == {
        "TRAINGUARD_NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}},
        "TRAINGUARD_HYPERPOD_LABELS": "false",
    }
    # Without the flag: no agent.
    _, plain, _ = manifests()
    assert AGENT not in {d["metadata"]["name"] for d in plain}


def test_reading_the_kernel_log_is_the_one_privileged_option() -> None:
    code, docs, _ = manifests("--health-agent-kernel-log", "--hyperpod-labels")
    assert code == 0
    for doc in docs:
        validate(doc)
    pod = named(docs, "DaemonSet", AGENT)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsUser": 0}
    (container,) = pod["containers"]
    assert container["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    assert container["args"][-1] == "--kmsg"
    assert env_of(container)["TRAINGUARD_HYPERPOD_LABELS"] == "true"
    deployment = named(docs, "Deployment", "trainguard-operator")
    operator_env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
    assert OperatorConfig.from_env(operator_env).health_label == (
        "sagemaker.amazonaws.com/node-health-status"
    )


def test_without_node_labels_the_install_is_namespaced_again() -> None:
    code, docs, _ = manifests("--no-node-labels")
    assert code == 0
    kinds = [d["kind"] for d in docs]
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    deployment = named(docs, "Deployment", "trainguard-operator")
    env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
    assert env["TRAINGUARD_NODE_LABELS"] == "false"
    assert OperatorConfig.from_env(env).node_labels is False


_DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.mark.parametrize(
    ("values", "settings", "agent"),
    [
        (
            {"healthAgent": {"enabled": True, "kernelLog": False}},
            OperatorConfig(),
            HealthAgentOptions(),
        ),
        (
            {"healthAgent": {"enabled": True, "kernelLog": True}},
            OperatorConfig(),
            HealthAgentOptions(kernel_log=True),
        ),
        (
            {
                "operator": {**_DEFAULTS["operator"], "hyperpodLabels": True, "nodeLabels": False},
                "healthAgent": {"enabled": True, "kernelLog": False},
            },
            OperatorConfig(hyperpod_labels=True, node_labels=False),
            HealthAgentOptions(),
        ),
        (
            {"operator": {**_DEFAULTS["operator"], "nodeLabels": False}},
            OperatorConfig(node_labels=False),
            None,
        ),
    ],
)
def test_helm_chart_renders_the_health_objects_of_the_install_flags(
    values: dict[str, Any], settings: OperatorConfig, agent: HealthAgentOptions | None
) -> None:
    rendered = chart_objects("ops", values)
    for doc in rendered:
        validate(doc)
    expected = [
        o
        for o in operator_objects("ops", settings=settings, health_agent=agent)
        if o["kind"] != "Namespace"
    ]
    assert sorted(rendered, key=_key) == sorted(expected, key=_key)


def test_install_applies_the_health_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kube_harness import ApiServer

    # kmock cannot serve /api/v1/namespaces (its path parser needs a namespace name).
    everything = kube_cli.all_objects
    monkeypatch.setattr(
        kube_cli, "all_objects", lambda *a: [o for o in everything(*a) if o["kind"] != "Namespace"]
    )
    server = ApiServer()
    try:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["install", "--health-agent", "--kubeconfig", kubeconfig]) == 0
        lines = out.getvalue().splitlines()
        assert lines[-4:] == [
            f"serviceaccount/{AGENT} created",
            f"clusterrole/{AGENT} created",
            f"clusterrolebinding/{AGENT} created",
            f"daemonset/{AGENT} created",
        ]
        assert "clusterrole/trainguard-operator-nodes created" in lines
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["uninstall", "--health-agent", "--kubeconfig", kubeconfig]) == 0
        assert out.getvalue().splitlines()[0] == f"daemonset/{AGENT} deleted"
    finally:
        server.stop()
