"""The node health agent (the DaemonSet's ``python -m trainguard.kube.health_agent``)
against kmock's API server: its Node labelled InProgress while the checks run, then
Passed or Failed; a kernel-log finding (the ``$TRAINGUARD_KERNEL_LOG`` hook) labels and
taints it; and the DaemonSet's own pod, run by the harness kubelet, does the same."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import wait_for
from kube_harness import ApiServer, Kubelet
from trainguard.health import CheckResult, HealthWatch, xid_line
from trainguard.kube.api import KubeApi
from trainguard.kube.config import OperatorConfig
from trainguard.kube.health_agent import HealthAgent, main, make_agent
from trainguard.kube.health_manifests import HealthAgentOptions, health_agent_objects
from trainguard.kube.node_labels import HealthKeys

Obj = dict[str, Any]
STATUS = "trainguard.dev/node-health-status"
DEEP = "trainguard.dev/deep-health-check-status"
TAINT = "trainguard.dev/unhealthy"
REASON = "trainguard.dev/node-health-reason"
KEYS = HealthKeys(STATUS, DEEP)
_names = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    server = ApiServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(server: ApiServer, tmp_path_factory: pytest.TempPathFactory) -> KubeApi:
    kubeconfig = server.write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig")
    return KubeApi.connect(str(kubeconfig))


def new_node(api: KubeApi, labels: dict[str, str] | None = None) -> str:
    name = f"machine-{next(_names)}"
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
    api.core.create_node(body, _preload_content=False)
    return name


def labels_of(api: KubeApi, node: str) -> dict[str, str]:
    return dict(api.get_node(node)["metadata"].get("labels") or {})


def taints_of(api: KubeApi, node: str) -> list[Obj]:
    return list((api.get_node(node).get("spec") or {}).get("taints") or [])


class Spy:
    """A passing check that notes what its Node's labels are while it runs."""

    name = "spy"
    timeout = 10.0

    def __init__(self, api: KubeApi, node: str) -> None:
        self.api, self.node = api, node
        self.seen: list[tuple[dict[str, str], list[Obj]]] = []

    def run(self) -> CheckResult:
        self.seen.append((labels_of(self.api, self.node), taints_of(self.api, self.node)))
        return CheckResult(self.name, "passed", "fine")


def test_a_healthy_node_is_held_while_its_checks_run_then_passes(api: KubeApi) -> None:
    node = new_node(api)
    spy = Spy(api, node)
    agent = HealthAgent(api, node, KEYS, [spy], HealthWatch([]))
    assert [r.outcome for r in agent.start()] == ["passed"]
    held = {"key": TAINT, "value": "Unschedulable", "effect": "NoSchedule"}
    assert spy.seen == [({STATUS: "Unschedulable", DEEP: "InProgress"}, [held])]
    assert labels_of(api, node) == {STATUS: "Schedulable", DEEP: "Passed"}
    assert taints_of(api, node) == []
    assert "passed" in api.get_node(node)["metadata"]["annotations"][REASON]


def test_a_failing_check_labels_the_node_failed_and_taints_it(api: KubeApi, tmp_path: Path) -> None:
    node = new_node(api)
    agent = make_agent(
        api, node, KEYS, checks=["cpu", "disk"], work_dir=str(tmp_path), fail=["cpu"], env={}
    )
    results = agent.start()
    assert [(r.name, r.outcome) for r in results] == [("cpu", "failed"), ("disk", "passed")]
    assert labels_of(api, node) == {STATUS: "Unschedulable", DEEP: "Failed"}
    assert taints_of(api, node) == [
        {"key": TAINT, "value": "Unschedulable", "effect": "NoSchedule"}
    ]
    reason = api.get_node(node)["metadata"]["annotations"][REASON]
    assert reason.startswith("health agent: deep health check failed: cpu: failed by injection")


def test_a_status_the_node_had_before_is_kept_after_a_pass(api: KubeApi) -> None:
    node = new_node(api, {STATUS: "UnschedulablePendingReboot"})
    agent = HealthAgent(api, node, KEYS, [Spy(api, node)], HealthWatch([]))
    agent.start()
    assert labels_of(api, node) == {STATUS: "UnschedulablePendingReboot", DEEP: "Passed"}
    assert [t["value"] for t in taints_of(api, node)] == ["UnschedulablePendingReboot"]
    # An earlier run's failure is kept too; a run killed during its checks is not.
    failed = new_node(api, {STATUS: "Unschedulable", DEEP: "Failed"})
    HealthAgent(api, failed, KEYS, [Spy(api, failed)], HealthWatch([])).start()
    assert labels_of(api, failed) == {STATUS: "Unschedulable", DEEP: "Passed"}
    killed = new_node(api, {STATUS: "Unschedulable", DEEP: "InProgress"})
    HealthAgent(api, killed, KEYS, [Spy(api, killed)], HealthWatch([])).start()
    assert labels_of(api, killed) == {STATUS: "Schedulable", DEEP: "Passed"}
    assert taints_of(api, killed) == []


def test_an_xid_in_the_kernel_log_labels_the_node_for_replacement(
    api: KubeApi, tmp_path: Path
) -> None:
    node = new_node(api)
    log = tmp_path / "kernel.log"
    log.write_text("boot line\n")
    env = {"TRAINGUARD_KERNEL_LOG": str(log)}
    agent = make_agent(api, node, KEYS, checks=["disk"], work_dir=str(tmp_path), env=env)
    assert [m.name for m in agent.watch.monitors] == ["kernel-log", "nvidia-smi"]
    agent.start()
    assert agent.look() == []
    with log.open("a") as out:
        out.write(xid_line(79, "0000:3b:00", 4242) + "\n")
    findings: list[Any] = []

    def found() -> bool:
        findings.extend(agent.look())
        return bool(findings)

    wait_for(found, 10)
    assert [(f.kind, f.action) for f in findings] == [("XID", "replace")]
    assert labels_of(api, node) == {STATUS: "UnschedulablePendingReplacement", DEEP: "Passed"}
    assert taints_of(api, node) == [
        {"key": TAINT, "value": "UnschedulablePendingReplacement", "effect": "NoSchedule"}
    ]
    reason = api.get_node(node)["metadata"]["annotations"][REASON]
    assert reason.startswith("health agent: XID: XID 79 on GPU 0000:3b:00")
    agent.watch.close()


def test_bad_checks_and_monitors_are_refused(api: KubeApi, tmp_path: Path) -> None:
    work = str(tmp_path)
    with pytest.raises(ValueError, match="connectivity: needs a job's nodes"):
        make_agent(api, "n", KEYS, checks=["InstanceConnectivity"], work_dir=work)
    with pytest.raises(ValueError, match="unknown monitor 'dmesg'"):
        make_agent(api, "n", KEYS, checks=["cpu"], monitors=["dmesg"], work_dir=work)
    with pytest.raises(ValueError, match="--fail-check gpu: not among the checks"):
        make_agent(api, "n", KEYS, checks=["cpu"], fail=["gpu"], work_dir=work)
    with pytest.raises(ValueError, match="unknown health check 'cpus'"):
        make_agent(api, "n", KEYS, checks=["cpus"], work_dir=work)
    with pytest.raises(SystemExit):
        main(["--checks", "cpu"])  # no Node named (no --node, no $TRAINGUARD_NODE_NAME)


def test_the_daemonsets_pod_labels_its_node_and_an_xid_taints_it(
    server: ApiServer, api: KubeApi, tmp_path: Path
) -> None:
    """The DaemonSet's pod template as the manifests make it, run on a Node by the kubelet
    (its process connects with the kubeconfig in its $HOME)."""
    (tmp_path / ".kube").mkdir()
    server.write_kubeconfig(tmp_path / ".kube" / "config")
    node = f"gpu-{secrets.token_hex(3)}"
    kubelet = Kubelet(server, api, tmp_path, {node: {}})
    try:
        objects = health_agent_objects("default", "img", OperatorConfig(), HealthAgentOptions())
        daemonset = next(o for o in objects if o["kind"] == "DaemonSet")
        spec = daemonset["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["command"] == ["python", "-m", "trainguard.kube.health_agent"]
        # Quick checks for the test, and the kernel-log hook.
        log = tmp_path / "kernel.log"
        log.write_text("")
        container["args"] = [
            *["--work-dir", str(tmp_path / "work"), "--checks", "cpu,disk", "--interval", "0.2"]
        ]
        container["env"].append({"name": "TRAINGUARD_KERNEL_LOG", "value": str(log)})
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"health-agent-{node}", "namespace": "default"},
            "spec": {**spec, "nodeName": node},  # as the DaemonSet controller places it
        }
        api.create_pod("default", pod)
        wait_for(lambda: labels_of(api, node).get(DEEP) == "Passed", 60)
        assert labels_of(api, node)[STATUS] == "Schedulable"
        with log.open("a") as out:
            out.write(xid_line(48, "0000:3b:00") + "\n")  # double-bit ECC: a reboot
        wait_for(lambda: labels_of(api, node).get(STATUS) == "UnschedulablePendingReboot", 30)
        assert taints_of(api, node) == [
            {"key": TAINT, "value": "UnschedulablePendingReboot", "effect": "NoSchedule"}
        ]
        output = kubelet.process(f"health-agent-{node}").log.read_text()
        assert f"node {node}: checks cpu, disk; monitors kernel-log, nvidia-smi" in output
    finally:
        kubelet.stop()
