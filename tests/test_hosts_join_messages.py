"""Waiting for hosts: a joining host that cannot reach the endpoint says so (after a
short bound, then periodically), a controller host whose endpoint is a loopback address
(Debian's '127.0.1.1 host0') names it as such, and one SIGTERM ends the wait."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

import trainguard.hosts.daemon as daemon_module
from conftest import FAKE_WORKER, Trainguard
from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.daemon import HostDaemon, JoinError
from trainguard.hosts.run import loopback_endpoint
from trainguard.platform.procs import free_port


def test_a_join_that_nobody_answers_is_said_then_said_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(daemon_module, "JOIN_QUIET_SECONDS", 0.3)
    monkeypatch.setattr(daemon_module, "JOIN_REMIND_SECONDS", 0.6)
    said: list[str] = []
    port = free_port("127.0.0.1")  # nothing listens there
    daemon = HostDaemon(
        JobEndpoint("127.0.0.1", port),
        "token",
        LocalAddress("127.0.0.1", "lo"),
        {},
        lambda reply: None,  # type: ignore[arg-type,return-value]  # never joined
        join_timeout=2.0,
        say=said.append,
    )
    try:
        with pytest.raises(JoinError, match="could not join"):
            daemon.join()
    finally:
        daemon.server.close()
    told = [line for line in said if line.startswith("cannot reach the controller")]
    assert 2 <= len(told) <= 4, said
    assert f"127.0.0.1:{port}" in told[0] and "--rdzv-endpoint" in told[0]
    assert "Connection refused" in told[0] or "refused" in told[0].lower(), told[0]


def test_an_endpoint_served_on_a_loopback_address_is_named_as_such() -> None:
    why = loopback_endpoint(JobEndpoint("host0", 29500), LocalAddress("127.0.1.1", "lo"))
    assert why is not None
    assert "127.0.1.1" in why and "loopback" in why and "127.0.1.1 host0" in why
    assert loopback_endpoint(JobEndpoint("host0", 29500), LocalAddress("10.0.0.1", "eth0")) is None


def test_one_sigterm_ends_the_wait_for_hosts_and_the_job_is_stopped(tmp_path: Path) -> None:
    tg = Trainguard(tmp_path)
    tg.env["TRAINGUARD_TOKEN"] = "t" * 32
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    run = tg.popen(
        "run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
        "--join-timeout", "300", str(FAKE_WORKER),
    )  # fmt: skip
    try:
        assert run.stderr is not None
        for line in run.stderr:  # the controller waits for the host that never comes
            if "more hosts to join" in line:
                break
        run.send_signal(signal.SIGTERM)  # once
        sent = time.monotonic()
        _, err = run.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130, err
    assert took < 50, took  # not the join timeout
    assert "SIGTERM" in err and "while waiting for hosts to join" in err, err
    job = tg.only_job()
    assert job["phase"] == "Stopped", job
