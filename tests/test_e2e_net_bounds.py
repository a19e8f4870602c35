"""A hostile host beside a job on namespace hosts (issue 38): it floods every port the
job opens with idle connections and malformed requests, with the controller at
``ulimit -n 1024``, and it tries to poison the rendezvous store. The job carries on.
Needs root (tests/netns_hosts.py); skipped elsewhere."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hosts_jobs import REPO, HostRun, HostsJob, endpoint
from netns_hosts import Host, NamespaceHosts

pytestmark = [pytest.mark.e2e, pytest.mark.long]

STEPS = str(REPO / "tests" / "scripts" / "step_worker.py")
STORE_STEPS = str(REPO / "tests" / "scripts" / "store_steps.py")
ATTACK = str(REPO / "tests" / "scripts" / "net_attack.py")
Make = Callable[..., NamespaceHosts]


def job_argv(hosts: NamespaceHosts, *script: str) -> list[str]:
    return ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint(hosts),
            "--join-timeout", "120", *script]  # fmt: skip


def wait_for_text(run: HostRun, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in run.output():
        assert time.monotonic() < deadline and run.proc.poll() is None, run.output()
        time.sleep(0.1)


def listening(hosts: NamespaceHosts, host: Host, pid: int | None = None) -> list[str]:
    """``ADDR:PORT`` of every TCP port open on ``host``'s address (the job's ports), or
    only those of process ``pid``."""
    done = hosts.run(host, ["ss", "-ltnpH"])
    lines = [ln for ln in done.stdout.splitlines() if pid is None or f"pid={pid}," in ln]
    ports = re.findall(rf"\s{re.escape(host.addr)}:(\d+)\s", "\n".join(lines) + "\n")
    return [f"{host.addr}:{p}" for p in sorted(set(ports))]


def test_a_flood_of_idle_connections_and_junk_does_not_hurt_the_job(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(3, prefix="flood")
    job = HostsJob(hosts)
    argv = ["--max-restarts", "0", *job_argv(hosts, STEPS, "4000")]  # ~40 s of steps
    controller = job.start(hosts[0], argv, tmp_path, nofile=1024)
    member = job.start(hosts[1], argv, tmp_path, nofile=1024)
    wait_for_text(controller, "Step 300", 180)
    ports = listening(hosts, hosts[0]) + listening(hosts, hosts[1])
    assert endpoint(hosts) in ports, ports
    others = [p for p in ports if p != endpoint(hosts)]
    # 1,100 at the controller's endpoint alone (its descriptors: 1024), 600 at the rest.
    floods = [
        hosts.popen(hosts[2], [sys.executable, ATTACK, "flood", str(n), "20", *to], cwd=REPO,
                    stdout=subprocess.PIPE, text=True)
        for n, to in ((1100, [endpoint(hosts)]), (600, others))
    ]  # fmt: skip
    for flood in floods:
        out, _ = flood.communicate(timeout=120)
        assert "held" in out and "flood over" in out, out
    assert [controller.proc.wait(240), member.proc.wait(120)] == [0, 0], job.outputs()
    data = job.describe(controller)
    assert data["phase"] == "Succeeded" and data["restarts"] == 0, data
    assert not data["faults"], data["faults"]
    for run in (controller, member):  # main printed 19,723 EMFILE tracebacks here (8 MB)
        text = run.output()
        assert "Traceback" not in text and "Too many open files" not in text, text[-5000:]
        assert "exception was never retrieved" not in text, text[-5000:]
    text = controller.output()
    refusals = text.count(f"refused a connection from {hosts[2].addr}")
    assert 1 <= refusals <= 20, text[-5000:]  # one line per 10 s, not one per connection
    assert len(text.encode()) < 2_000_000  # ~4000 step lines and a few notes


def test_a_store_client_from_another_host_is_refused_and_the_next_attempt_forms(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(3, prefix="poison")
    job = HostsJob(hosts)
    argv = job_argv(hosts, STORE_STEPS, "600")
    inject = ["--max-restarts", "1", "--inject", "kill:rank=1@step=300"]
    service = {"TRAINGUARD_RENDEZVOUS_STORE": "service"}  # the tests' default is rank0
    controller = job.start(hosts[0], [*inject, *argv], tmp_path, env=service)
    member = job.start(hosts[1], ["--max-restarts", "1", *argv], tmp_path, env=service)
    wait_for_text(controller, "Step 100", 180)
    # The service's doors: this attempt's store and the next one's (opened ahead).
    job_id = job.describe(controller)["id"]
    state = controller.state / "jobs" / job_id / "rendezvous.json"
    doors = listening(hosts, hosts[0], json.loads(state.read_text())["pid"])
    assert len(doors) >= 2, (doors, listening(hosts, hosts[0]))
    attack = hosts.run(hosts[2], [sys.executable, ATTACK, "poison", *doors], timeout=120, cwd=REPO)
    results = attack.stdout.splitlines()
    assert results and all(r.startswith("refused ") for r in results), attack
    assert [controller.proc.wait(240), member.proc.wait(120)] == [0, 0], job.outputs()
    data = job.describe(controller)
    assert data["phase"] == "Succeeded" and data["restarts"] == 1, data
    log = (controller.state / "jobs" / data["id"] / "logs" / "rendezvous.log").read_text()
    assert f"refused a store client from {hosts[2].addr}: not a job host" in log, log
