"""Which host is which node (hosts/roster.py), the endpoint and token rules, the agents'
lease: pure values, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.agent.lease import ControllerLease
from trainguard.control.contact import Contact, ContactRule, contact
from trainguard.control.reports import NodeReport
from trainguard.hosts.addresses import JobEndpoint, is_local, parse_endpoint, route_to
from trainguard.hosts.roster import JoinRefused, Roster, spec_differences
from trainguard.hosts.security import TOKEN_ENV, TokenError, job_token
from trainguard.wire.hosts import JoinRequest

SPEC = {"spec": {"nprocPerNode": 2, "replicaSpecs": [{"replicas": 3}]}}


def request(
    host: str, rank: int | None = None, spec: dict | None = None, hid: str = ""
) -> JoinRequest:  # type: ignore[type-arg]
    return JoinRequest(
        hostname=host,
        addr=f"10.0.0.{ord(host[-1]) % 200}",
        node_rank=rank,
        host_id=hid or f"{host}-id",
        daemon_url=f"http://{host}:1",
        spec=spec if spec is not None else SPEC,
    )


def roster(spares: int = 1) -> Roster:
    r = Roster(("node-0", "node-1", "node-2"), tuple(f"node-{3 + i}" for i in range(spares)), SPEC)
    r.add_controller_host("ctl", "h0", "10.0.0.1", "eth0", 0.0)
    return r


def test_hosts_fill_the_nodes_in_join_order_then_wait_as_spares() -> None:
    r = roster(spares=1)
    assert (r.join(request("h1"), 1.0).node_id, r.hosts["h1-id"].role) == ("node-1", "node")
    assert r.join(request("h2"), 2.0).node_id == "node-2"
    spare = r.join(request("h3"), 3.0)
    assert (spare.node_id, spare.role) == ("node-3", "spare")
    with pytest.raises(JoinRefused, match="h4 is late: the job's 3 nodes and 1 spares"):
        r.join(request("h4"), 4.0)
    assert r.joined(["node-0", "node-1", "node-2"]) == []


def test_node_ranks_are_claimed_and_a_taken_rank_is_refused_naming_its_holder() -> None:
    r = roster()
    assert r.join(request("h2", rank=2), 1.0).node_id == "node-2"
    assert r.join(request("h1"), 2.0).node_id == "node-1"  # the lowest free one
    with pytest.raises(JoinRefused, match=r"--node-rank 2 is taken by host h2 \(10\.0\.0\."):
        r.join(request("h9", rank=2), 3.0)
    with pytest.raises(JoinRefused, match="--node-rank 7: the job has 3 nodes"):
        r.join(request("h8", rank=7), 3.0)


def test_a_join_retried_by_the_same_daemon_gets_the_same_answer() -> None:
    r = roster()
    first = r.join(request("h1"), 1.0)
    assert r.join(request("h1"), 5.0) is first and first.last_seen == 5.0


def test_another_process_on_a_host_that_takes_part_is_refused() -> None:
    r = roster()
    r.join(request("h1"), 1.0)
    with pytest.raises(JoinRefused, match=r"h1 .* already takes part as node-1"):
        r.join(request("h1", hid="another-process"), 2.0)


def test_a_host_with_another_job_is_refused_naming_what_differs() -> None:
    other = {"spec": {"nprocPerNode": 4, "replicaSpecs": [{"replicas": 3}]}}
    with pytest.raises(
        JoinRefused, match=r"another job: spec\.nprocPerNode: 2 on the controller, 4 on"
    ):
        roster().join(request("h1", spec=other), 1.0)
    assert spec_differences({"a": {"b": 1}}, {"a": {"c": 1}}) == [
        "a.b: 1 on the controller, unset on the host",
        "a.c: unset on the controller, 1 on the host",
    ]
    assert spec_differences({"l": [{"x": 1}, 2]}, {"l": [{"x": 3}, 2]}) == [
        "l[0].x: 1 on the controller, 3 on the host"
    ]


def test_a_refusal_shows_the_part_that_differs_not_a_cut_off_prefix() -> None:
    # Seen: "command: ['/home/me/proj/.venv/bin/python', '-u', '/home/me/proj/tra..."
    # on both sides, the differing script name cut off.
    python = "/home/me/proj/.venv/bin/python"
    ours = {"command": [python, "-u", "/home/me/proj/train.py", "--lr", "0.1"]}
    theirs = {"command": [python, "-u", "/home/me/proj/train.py"]}
    assert spec_differences(ours, theirs) == [
        "command[3:]: ['--lr', '0.1'] on the controller, [] on the host"
    ]
    long = "/home/me/projects/language-models/experiments/2026/run"
    assert spec_differences({"script": long + "-a.py"}, {"script": long + "-b.py"}) == [
        "script: ...'xperiments/2026/run-a.py' on the controller, "
        "...'xperiments/2026/run-b.py' on the host"
    ]


def test_a_host_declared_lost_is_fenced_and_comes_back_only_as_a_new_spare() -> None:
    r = roster(spares=1)
    r.join(request("h1"), 1.0)
    r.join(request("h2"), 1.0)
    lost = r.lose("node-1")
    assert lost is not None and lost.lost and r.holder("node-1") is None
    with pytest.raises(JoinRefused, match="declared lost as node-1: it may rejoin only as a new"):
        r.join(request("h1"), 2.0)
    assert r.join(request("h3"), 3.0).node_id == "node-3"  # the spec's spare
    back = r.join(request("h1", hid="h1-again"), 4.0)  # the same machine, a new daemon
    assert (back.node_id, back.role) == ("node-4", "spare")  # never its old id
    assert r.lose("node-0") is not None and r.holder("node-0") is not None  # never fenced


def test_endpoints_parse_as_torchrun_s() -> None:
    assert parse_endpoint("10.1.2.3:29400") == JobEndpoint("10.1.2.3", 29400)
    assert parse_endpoint("host-a") == JobEndpoint("host-a", 29500)
    assert parse_endpoint("[fd00::1]:5") == JobEndpoint("fd00::1", 5)
    for bad in ("", ":80", "h:0", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)
    assert is_local("127.0.0.1") and is_local("localhost") and not is_local("192.0.2.1")
    here = route_to("127.0.0.1")
    assert here.addr == "127.0.0.1" and here.ifname == "lo"


def test_a_job_across_hosts_needs_a_private_token(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match=r"--token-file FILE .* or \$TRAINGUARD_TOKEN"):
        job_token(None, {})
    assert job_token(None, {TOKEN_ENV: "x" * 20}) == "x" * 20
    with pytest.raises(TokenError, match="too short"):
        job_token(None, {TOKEN_ENV: "short"})
    token = tmp_path / "token"
    token.write_text("y" * 32 + "\n")
    token.chmod(0o644)
    with pytest.raises(TokenError, match="can be read by others than its owner"):
        job_token(str(token), {})
    os.chmod(token, 0o600)
    assert job_token(str(token), {}) == "y" * 32
    with pytest.raises(TokenError, match="does not exist"):
        job_token(str(tmp_path / "none"), {})


def test_the_agent_is_fenced_before_the_controller_may_declare_it_lost() -> None:
    now = [0.0]
    lease = ControllerLease(4.0, clock=lambda: now[0])
    assert lease.fenced() is None
    now[0] = 3.9
    assert lease.fenced() is None
    now[0] = 4.1
    assert "no request from the controller for 4.1s" in (lease.fenced() or "")
    lease.touch()
    assert lease.fenced() is None
    assert ControllerLease(None, clock=lambda: 1e9).fenced() is None  # one machine: never
    # The controller, for its part: 3 failed contacts are not enough before 8 s of silence.
    ACROSS_HOSTS = ContactRule(3, lost_after=8.0)
    silent = NodeReport("node-1", status=None, failed_contacts=5, silent_for=6.0)
    assert contact(silent, ACROSS_HOSTS) is Contact.PENDING  # never answered
    answered = NodeReport("n", status=_status(), failed_contacts=5, silent_for=6.0)
    assert contact(answered, ACROSS_HOSTS) is Contact.UP
    longer = NodeReport("n", status=_status(), failed_contacts=5, silent_for=8.5)
    assert contact(longer, ACROSS_HOSTS) is Contact.LOST
    assert contact(answered, ContactRule(3)) is Contact.LOST  # one machine: the count alone


def _status():  # type: ignore[no-untyped-def]
    import control_helpers as h

    return h.status("n")
