"""The rendezvous store service's door (issue 38, item 3), on loopback: a client from an
address that is not a job host reaches no store, a job host's client that bloats the
store is cut off at the memory bound, and junk costs the service's log a few lines.

Against the real service process (``trainguard.rendezvous.service``) and torch's own
``TCPStore`` client. ``127.0.0.7`` plays another host: a one-host job's door admits
``127.0.0.1`` and ``::1`` only (across hosts: the job's address and the joined hosts').
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import wait_for
from trainguard.rendezvous.client import StoreServiceHandle, start_service
from trainguard.rendezvous.gateway import MAX_MB_ENV

TOKEN = "store-door-token-0123456789"
MAX_MB = 64


@pytest.fixture(scope="module")
def service_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One service for the module (it imports torch): the bloat test runs last."""
    where = tmp_path_factory.mktemp("store-door")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MAX_MB_ENV, str(MAX_MB))
        handle = start_service(
            where / "rendezvous.json", TOKEN, 0.0, where / "rendezvous.log", start_timeout=120
        )
    try:
        assert handle.open(0) is not None
        yield where
    finally:
        handle.shutdown()


@pytest.fixture
def service(service_dir: Path) -> StoreServiceHandle:
    return StoreServiceHandle(service_dir / "rendezvous.json", TOKEN)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def service_pid(where: Path) -> int:
    import json

    return int(json.loads((where / "rendezvous.json").read_text())["pid"])


def client(port: int) -> object:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))


def test_a_client_from_another_address_reaches_no_store(
    service: StoreServiceHandle, service_dir: Path
) -> None:
    port = service.open(0)
    assert port is not None
    stranger = socket.socket()
    stranger.bind(("127.0.0.7", 0))
    stranger.settimeout(10)
    stranger.connect(("127.0.0.1", port))
    with pytest.raises((ConnectionResetError, BrokenPipeError, AssertionError)):
        for _ in range(50):  # the door hangs up before a byte reaches the store
            stranger.sendall(b"\x01" * 4096)
            assert stranger.recv(1) != b"", "hung up"
            time.sleep(0.05)
    log = service_dir / "rendezvous.log"
    wait_for(lambda: "refused a store client from 127.0.0.7: not a job host" in log.read_text())
    member = client(port)
    member.set("key", "value")  # type: ignore[attr-defined]
    assert member.get("key") == b"value"  # type: ignore[attr-defined]


def test_junk_costs_the_services_log_a_few_lines(
    service: StoreServiceHandle, service_dir: Path
) -> None:
    port = service.open(0)
    assert port is not None
    log = service_dir / "rendezvous.log"
    before = len(log.read_text().splitlines())
    # A valid greeting, then a key "of 2**60 bytes": torch's store prints a 17-line C++
    # trace for each (the probe's 309 MB log).
    message = b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 2**60)
    for _ in range(300):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as junk:
            junk.sendall(message)
    time.sleep(2.0)
    lines = log.read_text().splitlines()[before:]
    assert len(lines) < 40, "\n".join(lines[:60])


def test_a_client_that_bloats_the_store_is_cut_off_at_the_bound(
    service: StoreServiceHandle, service_dir: Path
) -> None:
    port = service.open(0)
    assert port is not None
    pid = service_pid(service_dir)
    bloater = client(port)
    before = rss(pid)
    value = os.urandom(8 << 20)
    with pytest.raises(Exception, match=r"(?i)connection|reset|broken|closed|timed out"):
        for i in range(40):  # 320 MiB, five times the bound
            bloater.set(f"bloat-{i}", value)  # type: ignore[attr-defined]
    grown = rss(pid) - before
    assert grown < (MAX_MB + 48) << 20, f"the service grew by {grown >> 20} MiB"
    wait_for(
        lambda: (
            "closed a store client from 127.0.0.1" in (service_dir / "rendezvous.log").read_text()
        )
    )
    light = client(port)  # a job's rank still gets its small keys through
    light.set("rank0", "10.0.0.1:29400")  # type: ignore[attr-defined]
    assert light.get("rank0") == b"10.0.0.1:29400"  # type: ignore[attr-defined]
