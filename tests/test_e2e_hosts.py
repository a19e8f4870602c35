"""One job on several hosts: network-namespace hosts, each with its own address and
hostname, the same ``trainguard run`` on each (tests/netns_hosts.py, tests/hosts_jobs.py).
Needs root; skipped elsewhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from hosts_jobs import REPO, HostRun, HostsJob, endpoint
from netns_hosts import Host, NamespaceHosts

pytestmark = [pytest.mark.e2e, pytest.mark.long]

DDP = str(REPO / "tests" / "scripts" / "ddp_script.py")
STEPS = str(REPO / "tests" / "scripts" / "step_worker.py")
Make = Callable[..., NamespaceHosts]


def torchrun_form(
    hosts: NamespaceHosts, nnodes: int, *script: str, join_timeout: float = 120
) -> list[str]:
    return ["--nnodes", str(nnodes), "--nproc-per-node", "1", "--rdzv-endpoint",
            endpoint(hosts), "--join-timeout", f"{join_timeout:g}", *script]  # fmt: skip


def test_a_plain_ddp_script_runs_with_the_same_command_on_three_hosts(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(3, prefix="host")
    job = HostsJob(hosts)
    argv = torchrun_form(hosts, 3, DDP, "--steps", "10")
    for host in hosts.hosts[1:]:  # any order: here the joining hosts first
        job.start(host, argv, tmp_path)
    job.start(hosts[0], argv, tmp_path)
    codes = job.wait()
    assert codes == [0, 0, 0], job.outputs()
    text = job.outputs()
    checksums = set(re.findall(r"checksum (-?[\d.e-]+)", text))
    assert len(checksums) == 1, text  # every rank trained the same model
    assert f"MASTER_ADDR={hosts[0].addr}" in text  # never 127.0.0.1
    controller = job.runs[-1]
    data = job.describe(controller)
    assert data["phase"] == "Succeeded"
    urls = [n["agent_url"] for n in data["nodes"]]
    assert sorted(u.split("//")[1].split(":")[0] for u in urls) == sorted(
        h.addr for h in hosts.hosts
    )


def test_a_sigkilled_rank_on_another_host_is_restarted(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(2, prefix="host")
    job = HostsJob(hosts)
    argv = ["--max-restarts", "1", *torchrun_form(hosts, 2, STEPS, "600")]
    job.start(hosts[1], argv, tmp_path)
    job.start(hosts[0], [*argv[:2], "--inject", "kill:rank=1@step=50", *argv[2:]], tmp_path)
    # While attempt 1 runs, describe on the controller's host gives every worker's pid
    # with its host, node-1's on host1 too (issue 39: none for remote workers).
    wait_for_text(job.runs[1], "AttemptStarted: attempt 1", 120)
    deadline = time.monotonic() + 60
    nodes = job.describe(job.runs[1])["nodes"]
    while not all(n["workers"] for n in nodes):
        assert time.monotonic() < deadline, nodes
        time.sleep(0.2)
        nodes = job.describe(job.runs[1])["nodes"]
    assert [(n["node_id"], n["host"]) for n in nodes] == [
        ("node-0", hosts[0].name), ("node-1", hosts[1].name)
    ], nodes  # fmt: skip
    assert [w["rank"] for n in nodes for w in n["workers"]] == [0, 1], nodes
    assert nodes[1]["worker_pids"] == [] and nodes[1]["workers"][0]["pid"] > 0, nodes
    codes = job.wait()
    assert codes == [0, 0], job.outputs()
    data = job.describe(job.runs[1])
    [fault] = data["faults"]
    assert fault["type"] == "WorkerCrash" and fault["rank"] == 1 and fault["node"] == "node-1"
    # The step the attempt reached (the kill's, or more: rank 0 is no DDP rank and goes
    # on until stopped), resumed from 0 (the script restarts): all of it lost.
    assert fault["fault_step"] >= 50 and fault["resumed_step"] == 0, fault
    assert fault["lost_steps"] == fault["fault_step"], fault
    assert data["restarts"] == 1 and data["phase"] == "Succeeded"
    joined = job.runs[0].output()  # the joined host prints the job's events too
    assert re.search(r"\d\d:\d\d:\d\d Fault: .*rank 1", joined), joined
    # ... and its record agrees with the controller's on the phase and the restarts.
    mine = job.describe(job.runs[0])
    assert (mine["phase"], mine["restarts"]) == ("Succeeded", 1), mine
    # `logs --rank` for a rank of the other host says where its log is.
    there = _logs(job.runs[1], data["id"], 1)
    assert there.returncode == 1 and f"on host {hosts[1].addr}" in there.stderr, there
    here = _logs(job.runs[0], data["id"], 0)
    assert here.returncode == 1 and "ran on another host" in here.stderr, here


def _logs(
    run: HostRun, job_id: str, rank: int, on: tuple[NamespaceHosts, Host] | None = None
) -> subprocess.CompletedProcess[str]:
    """``trainguard logs JOB --rank R`` with ``run``'s state (``on``: as a process of
    that host)."""
    env = {**os.environ, "TRAINGUARD_STATE_DIR": str(run.state)}
    argv = [sys.executable, "-m", "trainguard.cli", "logs", job_id, "--rank", str(rank)]
    if on is not None:
        argv = on[0].argv(on[1], argv)
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=60, cwd=REPO
    )  # fmt: skip


def test_hosts_that_cannot_take_part_get_a_clear_refusal(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(4, prefix="host")
    job = HostsJob(hosts)
    argv = torchrun_form(hosts, 2, STEPS, "1500")
    controller = job.start(hosts[0], argv, tmp_path)
    member = job.start(hosts[1], argv, tmp_path)
    # Another job (other flags), a wrong token, and a host arriving when the job is full.
    other = job.start(hosts[2], torchrun_form(hosts, 2, STEPS, "99"), tmp_path)
    wrong = job.start(hosts[3], argv, tmp_path, env={"TRAINGUARD_TOKEN": "not-the-token-at-all"})
    assert other.proc.wait(120) == 2 and wrong.proc.wait(120) == 2, job.outputs()
    assert (
        "another job: spec.replicaSpecs[0].template.spec.containers[0].command[3]: "
        "'1500' on the controller, '99' on the host" in other.output()
    ), other.output()
    assert "missing or wrong bearer token" in wrong.output()
    late = job.start(hosts[3], argv, tmp_path)
    assert late.proc.wait(120) == 2, job.outputs()
    assert "is late: the job's 2 nodes and 0 spares are all taken" in late.output()
    # Nothing is served unauthenticated beyond loopback: a request without the token.
    probe = (
        "import urllib.request, urllib.error\n"
        f"url = 'http://{endpoint(hosts)}/join'\n"
        "req = urllib.request.Request(url, data=b'{}', method='POST')\n"
        "try:\n urllib.request.urlopen(req, timeout=5)\n"
        "except urllib.error.HTTPError as e:\n print(e.code)\n"
    )
    refused = hosts.run(hosts[2], ["python3", "-c", probe])
    assert refused.stdout.strip() == "401", refused
    assert [controller.proc.wait(240), member.proc.wait(240)] == [0, 0], job.outputs()
    said = controller.output()  # the controller's side says whom it refused, and why
    assert f"refused host {hosts[2].name}" in said and "another job" in said, said
    assert "is late: the job's 2 nodes" in said, said
    assert f"refused a join from {hosts[3].addr}: missing or wrong bearer token" in said, said


def test_one_sigterm_ends_a_host_that_is_still_joining(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(2, prefix="host")
    job = HostsJob(hosts)
    # Nothing runs on host0 yet: host1 keeps asking to join until --join-timeout.
    joining = job.start(hosts[1], torchrun_form(hosts, 2, STEPS, join_timeout=300), tmp_path)
    deadline = time.monotonic() + 60
    while "joining the job at" not in joining.output() and time.monotonic() < deadline:
        time.sleep(0.2)
    joining.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == [130], job.outputs()
    assert "interrupted" in joining.output(), job.outputs()


def test_a_job_across_hosts_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_TOKEN"}
    env["TRAINGUARD_STATE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2", "--rdzv-endpoint",
         "127.0.0.1:29555", STEPS, "5"],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "needs a token every host shares: --token-file FILE" in done.stderr


def spec_with_spare(script: list[str], **trainguard: object) -> dict[str, object]:
    return {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "cut"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [
                {
                    "name": "workers",
                    "replicas": 2,
                    "spares": 1,
                    "template": {"spec": {"containers": [{"name": "t", "command": script}]}},
                }
            ],
            "runPolicy": {"jobMaxRetryCount": 2},
            "trainguard": trainguard,
        },
    }


def test_two_hosts_without_a_spare_survive_a_20s_cut_of_one_and_complete(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    """The restart after the cut needs a host: it waits for one (--join-timeout), as
    torchrun would, instead of spending every restart at once on "no host can run"; the
    cut host, back and fenced, rejoins as a new host and takes the node."""
    hosts = namespace_hosts(2, prefix="host")
    job = HostsJob(hosts)
    argv = ["--max-restarts", "3", *torchrun_form(hosts, 2, STEPS, "1500")]
    controller = job.start(hosts[0], argv, tmp_path)
    cut = job.start(hosts[1], argv, tmp_path)
    wait_for_text(cut, "Step 200", 120)
    hosts.cut(hosts[1])
    wait_for_text(controller, "waits up to 120s (--join-timeout) for a host", 60)
    time.sleep(max(0.0, 20 - 8))  # 20 s in all: ~8 s of it went to declaring node-1 lost
    hosts.restore(hosts[1])
    assert job.wait(timeout=300) == [0, 0], job.outputs()
    said = controller.output()
    assert "a host can run it now" in said, said
    data = job.describe(controller)
    assert data["phase"] == "Succeeded" and data["restarts"] == 1, data


def test_a_host_cut_off_mid_run_is_replaced_by_the_spare_host_and_fenced(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    hosts = namespace_hosts(3, prefix="host")
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(spec_with_spare(
        [sys.executable, "-u", STEPS, "3000"], partitionTimeoutSeconds=6
    )))  # fmt: skip
    job = HostsJob(hosts)
    argv = ["-f", str(spec), "--rdzv-endpoint", endpoint(hosts), "--join-timeout", "120"]
    controller = job.start(hosts[0], argv, tmp_path)
    cut = job.start(hosts[1], argv, tmp_path)
    wait_for_text(cut, "joined job", 120)  # node-1; the next host is the spare
    spare = job.start(hosts[2], argv, tmp_path)
    deadline = time.monotonic() + 120
    while "Step 200" not in cut.output() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "Step 200" in cut.output(), job.outputs()
    [node0] = [n for n in job.describe(controller)["nodes"] if n["node_id"] == "node-0"]
    hosts.cut(hosts[1])
    cut_at = time.monotonic()
    # Its workers are gone within partitionTimeoutSeconds (+ a lease): no split brain.
    while time.monotonic() - cut_at < 30:
        alive = [p for p in hosts.pids(hosts[1]) if _is_worker(p)]
        if not alive:
            break
        time.sleep(0.5)
    gone_after = time.monotonic() - cut_at
    assert not alive, (alive, job.outputs())
    assert gone_after < 6 + 5, gone_after
    # `logs --rank 1` on the controller's host reads rank 1's log from the host that runs
    # it now: the spare host, whose node took node-1's ranks.
    job_id, deadline = job.describe(controller)["id"], time.monotonic() + 120
    while True:
        remote = _logs(controller, job_id, 1, on=(hosts, hosts[0]))
        if remote.returncode == 0 and "Step " in remote.stdout:  # host2 never ran it before
            break
        assert time.monotonic() < deadline, (remote, job.outputs())
        time.sleep(1.0)
    nodes = job.describe(controller)["nodes"]
    assert [n["host"] for n in nodes if 1 in n["ranks"]] == [hosts[2].name], nodes
    codes = [controller.proc.wait(300), spare.proc.wait(300)]
    assert codes == [0, 0], job.outputs()
    data = job.describe(controller)
    assert data["phase"] == "Succeeded"
    lost = [f for f in data["faults"] if f["type"] == "NodeLost"]
    assert lost and lost[0]["node"] == "node-1", data["faults"]
    assert "fenced: node-1 was declared lost" in controller.output()
    # node-0 kept its agent (and its warm worker template) across the job restart.
    assert [n["agent_pid"] for n in data["nodes"] if n["node_id"] == "node-0"] == [
        node0["agent_pid"]
    ], (node0, data["nodes"])
    hosts.restore(hosts[1])


def wait_for_text(run: HostRun, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in run.output():
        assert time.monotonic() < deadline, run.output()
        time.sleep(0.1)


def _is_worker(pid: int) -> bool:
    try:
        return "step_worker.py" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def test_an_in_process_restart_takes_its_state_from_a_peer_on_another_host(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    """The GPT example in resilient mode: rank 3 (the second host) is SIGKILLed; the
    survivors keep their processes, its replacement takes its state from a peer over the
    network, and no step is lost."""
    hosts = namespace_hosts(2, prefix="host")
    job = HostsJob(hosts)
    argv = ["-f", "examples/gpt/job-resilient.yaml", "--rdzv-endpoint", endpoint(hosts)]
    member = job.start(hosts[1], argv, tmp_path)
    controller = job.start(hosts[0], [*argv, "--inject", "kill:rank=3@step=100"], tmp_path)
    assert [controller.proc.wait(400), member.proc.wait(60)] == [0, 0], job.outputs()
    text = controller.output()
    assert "in-process restart" in text and "0 steps lost" in text, text
    joined = re.search(r"rank 3 joined attempt 1; state from peer rank (\d)", text)
    assert joined is not None and int(joined.group(1)) < 2, text  # a rank of the first host
    assert "rank 3: joined attempt 1" in member.output()  # its replacement ran on host 1


def make_certs(tmp: Path, addrs: list[str]) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for every host's address (one for all)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainguard test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address(a)) for a in addrs]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hosts")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    paths[2].chmod(0o600)
    return paths


def test_tls_between_hosts(namespace_hosts: Make, tmp_path: Path) -> None:
    """--tls-cert/--tls-key/--tls-ca: the endpoint, the daemons and the reports are HTTPS,
    checked against the job's CA; a host without that CA cannot join."""
    hosts = namespace_hosts(3, prefix="host")
    ca, cert, key = make_certs(tmp_path, [h.addr for h in hosts.hosts])
    tls = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]
    job = HostsJob(hosts)
    argv = [*tls, *torchrun_form(hosts, 2, STEPS, "1500")]
    controller = job.start(hosts[0], argv, tmp_path)
    member = job.start(hosts[1], argv, tmp_path)
    wait_for_text(member, "joined job", 120)
    untrusting = job.start(  # the CA left out: it cannot check the controller's certificate
        hosts[2], [*tls[:4], *torchrun_form(hosts, 2, STEPS, "1500", join_timeout=5)], tmp_path
    )
    assert [controller.proc.wait(240), member.proc.wait(60)] == [0, 0], job.outputs()
    assert untrusting.proc.wait(60) == 1, job.outputs()
    assert "CERTIFICATE_VERIFY_FAILED" in untrusting.output(), untrusting.output()
    assert "https://" in member.output()  # joined over HTTPS
    assert "Step 1500" in member.output()


def test_an_elastic_job_grows_when_a_host_joins_and_shrinks_when_one_is_cut(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    """--nnodes 2:3 across hosts: a third host joining is capacity (the job scales up to
    it), a host cut off is capacity taken away (the job scales down without it)."""
    hosts = namespace_hosts(3, prefix="host")
    job = HostsJob(hosts)
    worker = str(REPO / "tests" / "scripts" / "world_steps.py")
    argv = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint(hosts),
            "--join-timeout", "120", worker, "100000"]  # fmt: skip
    controller = job.start(hosts[0], argv, tmp_path)
    job.start(hosts[1], argv, tmp_path)
    wait_for_text(controller, "AttemptStarted: attempt 0: 2 nodes", 120)
    third = job.start(hosts[2], argv, tmp_path)
    wait_for_text(controller, "3 nodes x 1 ranks", 180)  # grown onto the third host
    wait_for_text(third, "world 3 rank 2", 60)
    wait_for_text(third, "Step 50", 60)
    hosts.cut(hosts[2])
    deadline = time.monotonic() + 120
    while True:  # shrunk without it
        text = controller.output()
        sizes = [int(n) for n in re.findall(r"AttemptStarted: attempt \d+: (\d) nodes", text)]
        if sizes[:3] == [2, 3, 2] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sizes[:3] == [2, 3, 2], text
    assert "ElasticScaling" in text and "scale down 3 -> 2" in text, text
    assert "cut off (its host went silent)" in text and " preempted" not in text, text
    controller.proc.terminate()  # the worker runs "forever": stop the job (Ctrl-C)
    assert controller.proc.wait(60) == 130, job.outputs()


def test_an_injected_partition_cuts_a_host_off_and_the_spare_takes_over(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    """--inject partition:node=1@step=S,for=T: node 1's host takes its own interface down
    (a rehearsal of a network partition); it is declared lost, the spare host takes its
    place, and once back it is told it was fenced and joins again as a new host."""
    hosts = namespace_hosts(3, prefix="host")
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(spec_with_spare([sys.executable, "-u", STEPS, "2500"])))
    job = HostsJob(hosts)
    argv = ["-f", str(spec), "--rdzv-endpoint", endpoint(hosts), "--join-timeout", "120"]
    controller = job.start(
        hosts[0], [*argv, "--inject", "partition:node=1@step=300,for=15"], tmp_path
    )
    cut = job.start(hosts[1], argv, tmp_path)
    wait_for_text(cut, "joined job", 120)
    spare = job.start(hosts[2], argv, tmp_path)
    assert [controller.proc.wait(300), spare.proc.wait(60)] == [0, 0], job.outputs()
    text = controller.output()
    assert "FaultInjected: injected partition:node=1@step=300,for=15" in text, text
    assert "node-1 lost" in text and "replacing node-1 -> node-2" in text, text
    # The spare host's agent was up, warm and idle, before it was needed.
    assert "node-2: this spare host's agent is up" in spare.output(), spare.output()
    wait_for_text(cut, "declared node-1 lost", 60)  # back on the network: fenced


def test_a_host_cut_off_is_replaced_in_place_by_the_spare_host_with_no_step_lost(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    """The GPT example in resilient mode with a spare host: node 1's host is cut off; the
    spare host's node takes its ranks in place, the ranks of node 0 keep their processes
    and state, and training goes on from the step it had reached (checkpointless)."""
    hosts = namespace_hosts(3, prefix="host")
    spec = yaml.safe_load((REPO / "examples" / "gpt" / "job-resilient.yaml").read_text())
    spec["spec"]["replicaSpecs"][0]["spares"] = 1
    spec["spec"]["trainguard"]["partitionTimeoutSeconds"] = 10
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    job = HostsJob(hosts)
    argv = ["-f", str(path), "--rdzv-endpoint", endpoint(hosts), "--join-timeout", "120"]
    controller = job.start(hosts[0], [*argv, "--inject", "partition:node=1@step=150"], tmp_path)
    cut = job.start(hosts[1], argv, tmp_path)
    wait_for_text(cut, "joined job", 120)
    spare = job.start(hosts[2], argv, tmp_path)
    assert [controller.proc.wait(400), spare.proc.wait(60)] == [0, 0], job.outputs()
    text = controller.output()
    assert "NodeReplacing" in text and "node-2 takes the ranks of node-1" in text, text
    recovered = re.search(
        r"Recovered: NodeLost .*\(in-process restart\); resumed from step \d+, (\d+) steps lost",
        text,
    )
    assert recovered is not None and recovered.group(1) == "0", text
    assert "state from own memory" in text  # node 0's ranks kept their processes
    assert re.search(r"rank [23] joined attempt \d+; state from peer rank [01]", text), text
