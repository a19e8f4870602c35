"""Health rehearsals in --inject: xid, disk-full (agent hooks) and health (at launch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.health import HOOK_DISK_FULL, HOOK_KERNEL_LOG
from trainguard.platform.inject import Injector, Targets, parse_injection


def test_health_injections_parse_with_their_targets() -> None:
    xid = parse_injection("xid:node=1,code=48@step=10")
    assert (xid.kind, xid.node, xid.code, xid.at_step) == ("xid", 1, 48, 10)
    assert parse_injection("xid:node=0@2s").code == 79  # fallen off the bus
    full = parse_injection("disk-full:node=1@1.5s")
    assert (full.kind, full.node, full.at_seconds) == ("disk-full", 1, 1.5)
    check = parse_injection("health:node=2,check=connectivity")
    assert (check.kind, check.node, check.check, check.at_step) == (
        "health",
        2,
        "connectivity",
        None,
    )


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("xid:node=1,code=0@step=1", "XID code (1..999)"),
        ("xid:rank=1@step=1", "xid takes a target node=N"),
        ("health:node=1,check=warp", "check must be one of"),
        ("health:node=1,check=disk@step=3", "no trigger"),
        ("disk-full:node=1", "expected one '@'"),
    ],
)
def test_bad_health_injections_name_the_problem(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match="--inject") as raised:
        parse_injection(spec)
    assert words in str(raised.value)


def test_xid_and_disk_full_write_the_node_agents_hooks(tmp_path: Path) -> None:
    specs = ["xid:node=1@step=5", "disk-full:node=0@step=7", "health:node=1,check=disk"]
    injector = Injector([parse_injection(s) for s in specs], world_size=2, nnodes=2)
    assert injector.health_failures == {1: ("disk",)}
    assert [i.kind for i in injector.pending] == ["xid", "disk-full"]  # health acts at launch
    hooks = {0: tmp_path / "node-0", 1: tmp_path / "node-1"}
    targets = Targets({}, {}, frozenset(), hooks)
    assert injector.poll(1.0, 4, 0.0, targets) == []
    [xid] = injector.poll(2.0, 5, 0.0, targets)
    assert xid.node == 1 and "XID line" in xid.message and "pid" not in xid.message
    assert "Xid (PCI:" in (hooks[1] / HOOK_KERNEL_LOG).read_text()
    [full] = injector.poll(3.0, 9, 0.0, targets)
    assert (hooks[0] / HOOK_DISK_FULL).exists() and full.injection.kind == "disk-full"
    assert injector.pending == []
    with pytest.raises(ValueError, match="node 4 is out of range"):
        Injector([parse_injection("health:node=4,check=cpu")], world_size=2, nnodes=2)
