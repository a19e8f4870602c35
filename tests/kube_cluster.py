"""A whole cluster for the operator's tests: the emulated API server, the harness kubelet
on a few fake Nodes, and the operator as a process (:func:`running_cluster`), with the
``trainguard`` CLI pointed at it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from conftest import FAKE_WORKER, REPO, wait_for
from kube_harness import ApiServer, Kubelet, free_port, quiet_port_base
from trainguard.cli import main
from trainguard.kube.api import KubeApi

JOB_TIMEOUT = 120.0


@dataclass
class Cluster:
    root: Path
    server: ApiServer
    api: KubeApi
    kubelet: Kubelet
    kubeconfig: Path
    env: dict[str, str]
    metrics_port: int
    operators: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start_operator()

    def start_operator(self) -> subprocess.Popen[bytes]:
        """One more replica of the operator (the first leads; the others stand by)."""
        with open(self.root / f"operator-{len(self.operators)}.log", "wb") as log:
            operator = subprocess.Popen(
                [sys.executable, "-m", "trainguard.kube.operator", "--namespace", "default"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.operators.append(operator)
        return operator

    def log(self, operator: subprocess.Popen[bytes]) -> str:
        return (self.root / f"operator-{self.operators.index(operator)}.log").read_text()

    def leader(self) -> subprocess.Popen[bytes] | None:
        """The live operator that leads (its log says it took the Lease)."""
        live = [o for o in self.operators if o.poll() is None]
        return next((o for o in live if "leading: took Lease" in self.log(o)), None)

    def standing_by(self) -> subprocess.Popen[bytes] | None:
        live = [o for o in self.operators if o.poll() is None]
        return next((o for o in live if "standing by" in self.log(o)), None)

    def tg(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The ``trainguard`` CLI against this cluster, in this process (no interpreter start)."""
        out, err = io.StringIO(), io.StringIO()
        argv = [*args, "--kubeconfig", str(self.kubeconfig)]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())

    def submit(self, name: str, command: list[str], **spec: Any) -> None:
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job_manifest(name, command, **spec)))
        done = self.tg("submit", "-f", str(path))
        assert done.returncode == 0, done.stderr

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.api.get_job("default", name).get("status") or {})

    def wait_phase(self, name: str, *phases: str, timeout: float = JOB_TIMEOUT) -> dict[str, Any]:
        wait_for(lambda: self.status(name).get("phase") in phases, timeout)
        return self.status(name)

    def describe(self, name: str) -> dict[str, Any]:
        done = self.tg("describe", "--kube", name, "-o", "json")
        assert done.returncode == 0, done.stderr
        data: dict[str, Any] = json.loads(done.stdout)
        return data

    def resilient_lines(self, name: str) -> str:
        """What the job's resilient workers said (``[trainguard.resilient]`` lines of its
        pods' logs, by pod): what a failed assertion on an in-place attempt should show."""
        found = []
        for (namespace, pod), log in sorted(self.server.logs.items()):
            if namespace != "default" or not pod.startswith(f"{name}-"):
                continue
            said = [line for line in log.read_text(errors="replace").splitlines()
                    if "[trainguard.resilient]" in line]  # fmt: skip
            found += [f"{pod}:", *(f"  {line[:300]}" for line in said[-20:])]
        return "\n".join(found)

    def metrics(self) -> str:
        """The operator's /metrics page (Prometheus' text format)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())


def job_manifest(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nprocPerNode": 2,
            "replicaSpecs": [
                {
                    "name": "pods",
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": "trainguard:test",
                                    "command": command,
                                    "workingDir": str(REPO),
                                }
                            ]
                        }
                    },
                }
            ],
            "trainguard": {"pollIntervalSeconds": 0.3, "stopGracePeriodSeconds": 3},
            **spec,
        },
    }


@contextlib.contextmanager
def running_cluster(root: Path, nodes: dict[str, dict[str, str]]) -> Iterator[Cluster]:
    """An API server, a kubelet on ``nodes`` (name -> labels) and one operator, all
    stopped on exit; files under ``root``."""
    server = ApiServer()
    kubeconfig = server.write_kubeconfig(root / "kubeconfig")
    api = KubeApi.connect(str(kubeconfig))
    kubelet = Kubelet(server, api, root, nodes)
    metrics_port, report_port = free_port(), free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "TRAINGUARD_AGENT_PORT": str(free_port()),
        "TRAINGUARD_RENDEZVOUS_PORT_BASE": str(quiet_port_base()),
        "TRAINGUARD_RENDEZVOUS_PORT_SPAN": "16",
        "TRAINGUARD_POD_LOG_DIR": str(root / "agent-logs"),
        "TRAINGUARD_POD_MEMORY_ROOT": str(root / "shm"),
        "TRAINGUARD_POD_JOB_ROOT": str(root / "jobs"),
        "TRAINGUARD_METRICS_PORT": str(metrics_port),
        # The pods (local processes) push their reports to the operator on this machine.
        "TRAINGUARD_REPORT_HOST": "127.0.0.1",
        "TRAINGUARD_REPORT_PORT": str(report_port),
        "TRAINGUARD_REPORT_URL": f"http://127.0.0.1:{report_port}",
        # Short Leases: a standby operator takes over within seconds of its leader's death.
        "TRAINGUARD_LEASE_SECONDS": "3",
    }
    cluster = Cluster(root, server, api, kubelet, kubeconfig, env, metrics_port)
    try:
        yield cluster
    finally:
        for operator in cluster.operators:
            operator.terminate()
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait()
        kubelet.stop()
        server.stop()


def fake(out: Path, *args: str) -> list[str]:
    return ["python", str(FAKE_WORKER), "--out", str(out), *args]


def record(out: Path, rank: int, attempt: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"rank-{rank}-attempt-{attempt}.json").read_text())
    return data
