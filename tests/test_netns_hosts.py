"""The multi-host harness (tests/netns_hosts.py): hosts made of network namespaces.

All but the first test need root and ``ip``/``nsenter``/``unshare``; they skip otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import netns_hosts
from conftest import pid_alive, wait_for
from netns_hosts import Host, NamespaceHosts

Make = Callable[..., NamespaceHosts]
PORT = 7000  # every host has its own ports; the bridge address is this instance's own
PY = sys.executable

ECHO_SERVER = textwrap.dedent("""
    import socket, sys, threading
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    def echo(conn):
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
""")

# For each target: "ping" when it answered, else the error's type (TimeoutError, OSError).
PROBE = textwrap.dedent("""
    import json, socket, sys
    out = {}
    for target in sys.argv[2:]:
        try:
            with socket.create_connection((target, int(sys.argv[1])), timeout=0.5) as s:
                s.sendall(b"ping")
                out[target] = s.recv(4).decode()
        except OSError as e:
            out[target] = type(e).__name__
    print(json.dumps(out))
""")

GLOO_ALL_REDUCE = textwrap.dedent("""
    import datetime, os, torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(t.item(), flush=True)
    dist.destroy_process_group()
""")


def probe(net: NamespaceHosts, host: Host, *targets: str) -> dict[str, str]:
    done = net.run(host, [PY, "-c", PROBE, str(PORT), *targets], timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, str] = json.loads(done.stdout)
    return result


def start_echo(net: NamespaceHosts, host: Host) -> subprocess.Popen[str]:
    proc = net.popen(
        host, [PY, "-c", ECHO_SERVER, "0.0.0.0", str(PORT)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def root_echo() -> Iterator[Callable[[str], None]]:
    """Start an echo server on the machine itself (outside the namespaces) at an address."""
    procs: list[subprocess.Popen[str]] = []

    def start(addr: str) -> None:
        proc = subprocess.Popen(
            [PY, "-c", ECHO_SERVER, addr, str(PORT)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    yield start
    for proc in procs:
        proc.kill()
        proc.communicate()


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_skips_with_a_reason_when_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns_hosts.unavailable_reason() == "namespace hosts need root"
    with netns_hosts.factory() as make, pytest.raises(pytest.skip.Exception, match="need root"):
        make(1)


def test_each_host_has_its_own_hostname_hosts_file_and_only_its_subnet(
    namespace_hosts: Make,
) -> None:
    machine_hostname, machine_hosts = socket.gethostname(), Path("/etc/hosts").read_text()
    net = namespace_hosts(3)
    names = [h.name for h in net.hosts]
    assert names == ["node0", "node1", "node2"]
    assert len({h.addr for h in net.hosts} | {net.bridge_addr}) == 4
    for h in net.hosts:
        assert net.run(h, ["hostname"]).stdout.strip() == h.name
        # Every name, its own included, resolves to the host's bridge address (not loopback).
        lines = net.run(h, ["getent", "hosts", *names]).stdout.splitlines()
        resolved = {line.split()[1]: line.split()[0] for line in lines}
        assert resolved == {x.name: x.addr for x in net.hosts}
        localhost = net.run(h, ["getent", "hosts", "localhost"]).stdout.split()[0]
        assert localhost in {"127.0.0.1", "::1"}
        addrs = net.run(h, ["ip", "-4", "-o", "addr", "show", "dev", h.ifname]).stdout
        assert f"inet {h.addr}/24" in addrs
        routes = net.run(h, ["ip", "-4", "route"]).stdout.splitlines()
        assert len(routes) == 1 and routes[0].split()[:3] == [str(net.subnet), "dev", h.ifname]
    assert socket.gethostname() == machine_hostname
    assert Path("/etc/hosts").read_text() == machine_hosts


def test_tcp_by_name_and_address_stops_on_cut_and_comes_back_on_restore(
    namespace_hosts: Make, root_echo: Callable[[str], None]
) -> None:
    net = namespace_hosts(3)
    h0, h1, _ = net.hosts
    start_echo(net, h0)
    start_echo(net, h1)
    root_echo(net.bridge_addr)
    reached = {"node0": "ping", h0.addr: "ping"}
    assert probe(net, h1, "node0", h0.addr) == reached
    assert probe(net, h0, "node1", net.bridge_addr) == {"node1": "ping", net.bridge_addr: "ping"}
    held = socket.create_connection((h0.addr, PORT), timeout=5)  # from the machine itself
    held.sendall(b"one!")
    assert held.recv(4) == b"one!"

    net.cut(h0)
    assert net.is_cut(h0)
    assert probe(net, h1, "node0", h0.addr) == {"node0": "TimeoutError", h0.addr: "TimeoutError"}
    assert probe(net, h0, "node1", net.bridge_addr) == {
        "node1": "TimeoutError",
        net.bridge_addr: "TimeoutError",
    }
    # Inside the cut host, loopback and its own address still work; the others are untouched.
    assert probe(net, h0, "127.0.0.1", "node0") == {"127.0.0.1": "ping", "node0": "ping"}
    assert probe(net, h1, net.bridge_addr) == {net.bridge_addr: "ping"}
    # An established connection is not reset: its data waits, and arrives after restore.
    held.sendall(b"two!")
    held.settimeout(0.5)
    with pytest.raises(TimeoutError):
        held.recv(4)

    net.restore(h0)
    assert not net.is_cut(h0)
    held.settimeout(15)
    assert held.recv(4) == b"two!"
    held.close()
    assert probe(net, h1, "node0", h0.addr) == reached
    assert probe(net, h0, "node1", net.bridge_addr) == {"node1": "ping", net.bridge_addr: "ping"}


def test_instances_are_separate(namespace_hosts: Make) -> None:
    a, b = namespace_hosts(1), namespace_hosts(1, prefix="other")
    assert a.tag != b.tag and not a.subnet.overlaps(b.subnet)
    assert b[0].name == "other0" and all(len(h.veth) <= 15 for h in [*a.hosts, *b.hosts])
    # No route out of an instance: other instances and the outside are unreachable at once.
    assert probe(a, a[0], b[0].addr, b.bridge_addr, "198.51.100.1") == dict.fromkeys(
        [b[0].addr, b.bridge_addr, "198.51.100.1"], "OSError"
    )


def test_gloo_all_reduce_across_three_hosts(namespace_hosts: Make) -> None:
    net = namespace_hosts(3)
    procs = []
    for h in net.hosts:
        env = {
            **os.environ,
            "RANK": str(h.index),
            "WORLD_SIZE": str(len(net)),
            "MASTER_ADDR": net[0].addr,
            "MASTER_PORT": "29500",
            "GLOO_SOCKET_IFNAME": h.ifname,
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            net.popen(h, [PY, "-c", GLOO_ALL_REDUCE], env=env, stdout=subprocess.PIPE, text=True)
        )
    for proc in procs:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0
        assert out.strip() == "6.0"


def test_close_kills_everything_and_removes_everything_even_when_the_body_raises(
    namespace_hosts: Make, tmp_path: Path
) -> None:
    net = namespace_hosts(2)
    pid_files = [tmp_path / f"{h.name}.pid" for h in net.hosts]
    started: list[subprocess.Popen[bytes]] = []
    with pytest.raises(RuntimeError, match="the test body failed"), net:
        for h, pid_file in zip(net.hosts, pid_files, strict=True):
            # A grandchild that leaves the session, and a child that stays.
            script = f"setsid sleep 300 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}"
            started.append(net.popen(h, ["sh", "-c", f"{script}; sleep 300"]))
        # A process in the namespace that was not started through popen.
        outsider = subprocess.Popen(["ip", "netns", "exec", net[1].netns, "sleep", "300"])
        wait_for(lambda: all(p.exists() for p in pid_files), timeout=30)
        grandchildren = [int(p.read_text()) for p in pid_files]
        for pid in grandchildren:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            assert int(stat[3]) == pid  # its own session
        wait_for(lambda: outsider.pid in net.pids(net[1]), timeout=30)
        raise RuntimeError("the test body failed")

    assert outsider.wait(timeout=10) == -signal.SIGKILL
    assert [p.returncode for p in started] == [-signal.SIGKILL] * 2
    assert not any(pid_alive(pid) for pid in grandchildren)
    assert not any(h.netns in netns_list() for h in net.hosts)
    assert net.tag not in links()
    assert not net.dir.exists()
    assert not (netns_hosts.RUN_DIR / f"{net.tag}.json").exists()
    net.close()  # idempotent


def test_run_past_its_timeout_kills_its_session(namespace_hosts: Make) -> None:
    net = namespace_hosts(1)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        net.run(net[0], ["sh", "-c", "sleep 300 & sleep 300"], timeout=0.5)
    assert time.monotonic() - started < 10
    assert net.pids(net[0]) == []


def test_what_a_dead_owner_left_is_removed_by_the_next_instance(namespace_hosts: Make) -> None:
    reason = netns_hosts.unavailable_reason()
    if reason:
        pytest.skip(reason)
    # The owner makes two hosts, starts a process on one, and dies once we have looked.
    owner = textwrap.dedent("""
        import os, signal, subprocess, sys, netns_hosts
        net = netns_hosts.NamespaceHosts(2)
        quiet = subprocess.DEVNULL  # not our pipes: they would stay open after we die
        proc = net.popen(net[0], ["sleep", "300"], stdout=quiet, stderr=quiet)
        print(net.tag, proc.pid, flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.Popen(
        [PY, "-c", owner], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    tag, orphan = proc.stdout.readline().split()
    assert tag in links() and pid_alive(int(orphan))
    proc.stdin.write("die\n")
    proc.stdin.close()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdout.close()

    namespace_hosts(1)
    assert tag not in links() and tag not in netns_list()
    assert not pid_alive(int(orphan))
    assert not (netns_hosts.RUN_DIR / f"{tag}.json").exists()
