"""The job's rendezvous store service (trainguard.rendezvous): every attempt's TCPStore
served outside the ranks, so groups form without rank 0 hosting anything.

Light tests first (the assignment's environment, the service's own contract with real
torch TCPStore clients); the real gloo groups, rank 0 SIGKILLed and replaced while the
store stays, are in the last test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from trainguard.auth import bearer
from trainguard.control.assignment import StoreEndpoint, assign_ranks
from trainguard.rendezvous.client import (
    MODE_ENV,
    StoreServiceHandle,
    find_service,
    rendezvous_mode,
    start_service,
)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TOKEN = "test-token"
START_WITHIN = 600.0  # s for a service to import torch on a machine shared with others


def _client(port: int, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=timeout))


def _closed(port: int, within: float) -> bool:
    """The store at ``port`` stops answering within ``within`` seconds (its server thread
    stops with its last reference, not necessarily before ``/open`` answers)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            _client(port, timeout=1.0).get("rank_0_addr")
        except Exception as exc:  # torch's DistStoreError / RuntimeError
            if re.search(r"(?i)connect|timed out|refused", str(exc)):
                return True
            raise
        time.sleep(0.5)
    return False


def _wait_gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def service(tmp_path: Path) -> Iterator[StoreServiceHandle]:
    handle = start_service(
        tmp_path / "rendezvous.json", TOKEN, 0.0, tmp_path / "service.log", START_WITHIN
    )
    yield handle
    handle.shutdown()


def test_a_service_stopped_while_it_starts_is_ended_not_waited_for(tmp_path: Path) -> None:
    # A job stopped before its first attempt (Ctrl-C while hosts join): the service is
    # still importing torch, has no port to be asked on, and used to be waited for
    # REQUEST_TIMEOUT, then killed.
    handle = start_service(tmp_path / "rendezvous.json", TOKEN, 0.0, None, START_WITHIN)
    process = handle._process
    assert process is not None
    handle.shutdown()
    assert process.returncode == -signal.SIGTERM
    assert not (tmp_path / "rendezvous.json").exists()


def test_a_hosted_endpoint_makes_every_rank_a_client() -> None:
    """torchrun's convention: TORCHELASTIC_USE_AGENT_STORE=True, MASTER_* the store's."""
    for hosted in (True, False):
        nodes = assign_ranks("job", ["a", "b"], 2, 3, StoreEndpoint("10.0.0.1", 4000, hosted), 3, 5)
        for node in nodes:
            for local in range(2):
                env = node.worker_env(local)
                assert env["TORCHELASTIC_USE_AGENT_STORE"] == str(hosted)
                assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "4000")


def test_the_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE_ENV, "rank0")
    assert rendezvous_mode() == "rank0"
    monkeypatch.delenv(MODE_ENV)
    assert rendezvous_mode() == "service"
    monkeypatch.setenv(MODE_ENV, "nodes")
    with pytest.raises(ValueError, match=MODE_ENV):
        rendezvous_mode()


def test_a_bad_mode_is_a_usage_error(tmp_path: Path) -> None:
    env = {**os.environ, MODE_ENV: "nodes", "TRAINGUARD_STATE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "run", str(SCRIPTS / "store_rank.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert f"{MODE_ENV}='nodes': expected one of service, rank0" in done.stderr


def test_each_attempt_gets_its_own_store_that_outlives_every_client(
    service: StoreServiceHandle, tmp_path: Path
) -> None:
    first = service.open(1)
    assert first is not None and service.open(1) == first  # the same attempt, the same store
    writer = _client(first)
    writer.set("rank_0_addr", "old")
    del writer  # a client (a rank) gone: the store and its keys stay
    assert _client(first).get("rank_0_addr") == b"old"
    second = service.open(2)  # opened ahead with attempt 1's: no wait for it
    assert second is not None and second != first
    assert not _client(second).check(["rank_0_addr"])  # never a previous attempt's keys
    assert service.open(3) is not None  # attempt 1's store is closed now
    assert _closed(first, within=60.0)
    state = json.loads((tmp_path / "rendezvous.json").read_text())
    health = urllib.request.Request(
        f"http://127.0.0.1:{state['control_port']}/health", headers=bearer("wrong")
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(health, timeout=10)
    assert refused.value.code == 401
    service.shutdown()
    assert _wait_gone(state["pid"], 30)
    assert not (tmp_path / "rendezvous.json").exists()


@pytest.mark.long  # two services, each importing torch: ~45 s on the busy 2-core VM
def test_a_resumed_controller_takes_the_service_over_and_it_ends_after_its_grace(
    tmp_path: Path,
) -> None:
    """The service outlives a dead controller by its grace; `trainguard resume` attaches."""
    state = tmp_path / "rendezvous.json"
    owner = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    env = {**os.environ, "TRAINGUARD_STORE_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "trainguard.rendezvous.service", "--state", str(state)]
    served = subprocess.Popen([*argv, "--owner", str(owner.pid), "--grace", "1"], env=env)
    try:
        handle = StoreServiceHandle(state, TOKEN, start_timeout=START_WITHIN)
        port = handle.open(5)
        assert port is not None
        _client(port).set("k", "v")
        owner.kill()
        owner.wait()
        resumed = find_service(state, TOKEN)  # this process is its owner now
        assert resumed is not None
        time.sleep(2.5)  # past the grace of the dead owner
        assert served.poll() is None
        assert _client(port).get("k") == b"v"  # the running attempt's store, intact
        assert find_service(tmp_path / "none.json", TOKEN) is None
        # Its owner gone for good (a second service, nobody attaching): it exits.
        lone_state = tmp_path / "lone.json"
        short = subprocess.Popen([sys.executable, "-c", "pass"])
        short.wait()
        lone = subprocess.Popen(
            [*argv[:-1], str(lone_state), "--owner", str(short.pid), "--grace", "0"], env=env
        )
        assert lone.wait(timeout=START_WITHIN) == 0
        assert not lone_state.exists()
        resumed.shutdown()
        assert served.wait(timeout=30) == 0
    finally:
        for proc in (owner, served):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _rank(rank: int, world: int) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "store_rank.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _order(procs: list[subprocess.Popen[str]], port: int) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"port": port}) + "\n")
        proc.stdin.flush()


def _sums(procs: list[subprocess.Popen[str]]) -> list[int]:
    out = []
    for proc in procs:
        assert proc.stdout is not None
        out.append(json.loads(proc.stdout.readline())["sum"])
    return out


@pytest.mark.long
def test_rank_0_sigkilled_and_replaced_while_the_store_stays(
    service: StoreServiceHandle,
) -> None:
    """Real gloo groups through the service: rank 0's death takes no store with it, the
    survivors rendezvous on the next attempt's store before a new rank 0 even exists."""
    world = 3
    procs = [_rank(r, world) for r in range(world)]
    try:
        first = service.open(1)
        assert first is not None
        _order(procs, first)
        assert _sums(procs) == [world] * world
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        store = _client(first)
        assert store.num_keys() > 0  # attempt 1's store and keys outlived rank 0
        second = service.open(2)
        assert second is not None
        joined = _client(second, timeout=120)
        before = joined.num_keys()
        _order(procs[1:], second)
        deadline = time.monotonic() + 120
        while joined.num_keys() <= before:  # the survivors' rendezvous keys, no rank 0
            assert time.monotonic() < deadline, joined.num_keys()
            time.sleep(0.05)
        procs[0] = _rank(0, world)  # the replacement: the same endpoint, nothing to bind
        _order(procs[:1], second)
        assert _sums(procs) == [world] * world
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.kill()
            proc.wait()
