"""The agent's health keeper (agent/health.py): deep checks, then monitors and hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from conftest import wait_for
from trainguard.agent.health import HOOK_DISK_FULL, HOOK_KERNEL_LOG, HealthKeeper
from trainguard.health.xid import xid_line
from trainguard.spec.health import HealthOptions


def keeper(
    tmp_path: Path, fail: tuple[str, ...] = (), **options: object
) -> tuple[HealthKeeper, threading.Event]:
    news = threading.Event()
    hooks = tmp_path / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    k = HealthKeeper(
        HealthOptions.model_validate(options).settings(),
        str(tmp_path),
        news.set,
        fail=fail,
        hooks=hooks,
    )
    return k, news


def test_deep_checks_are_in_progress_then_passed_or_failed(tmp_path: Path) -> None:
    k, news = keeper(tmp_path, fail=("disk",), onStart=["cpu", "disk"], continuous=[])
    assert k.report().deep == "InProgress" and k.report().checks == ()
    k.start()
    wait_for(news.is_set, 60)
    report = k.report()
    assert report.deep == "Failed"
    assert [(c.name, c.outcome) for c in report.checks] == [("cpu", "passed"), ("disk", "failed")]
    assert "injection" in report.checks[1].message
    k.stop()

    none, _ = keeper(tmp_path / "none", continuous=[])
    assert none.report().deep is None  # no on-start checks asked for


def test_monitors_number_each_finding_once_from_the_rehearsal_hooks(tmp_path: Path) -> None:
    k, news = keeper(tmp_path, continuous=["kernelLog", "disk"])
    k.start()
    try:
        assert k.watching.wait(30)
        hooks = tmp_path / "hooks"
        with open(hooks / HOOK_KERNEL_LOG, "a") as log:
            log.write(xid_line(79) + "\n")
        wait_for(lambda: len(k.report().findings) == 1, 30)
        [xid] = k.report().findings
        assert (xid.seq, xid.kind, xid.action, xid.evidence["code"]) == (0, "XID", "replace", 79)
        assert news.is_set()
        (hooks / HOOK_DISK_FULL).touch()
        total = 3 if os.path.isdir("/dev/shm") else 2  # the job dir, and /dev/shm
        wait_for(lambda: len(k.report().findings) == total, 30)
        disks = k.report().findings[1:]
        assert [(f.seq, f.kind) for f in disks] == [(n, "DiskSpace") for n in range(1, total)]
        assert disks[0].action == "replace"  # the job dir (/dev/shm asks for a reboot)
        with open(hooks / HOOK_KERNEL_LOG, "a") as log:
            log.write(xid_line(13) + "\n")  # an application's XID: not the node's fault
        threading.Event().wait(2.5)
        assert len(k.report().findings) == total
    finally:
        k.stop()


def test_the_agent_refuses_bad_health_flags(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "trainguard.agent", "--node-id", "n", "--token-env", "T"]
    base += ["--log-dir", str(tmp_path)]
    for flags, words in (
        (["--health", '{"checks": ["warp"]}'], "unknown health check 'warp'"),
        (["--health", '{"colour": 1}'], "colour: unknown field"),
        (["--health", "{}", "--health-peers", "0,2,host"], "--health-peers"),
    ):
        done = subprocess.run(
            [*base, *flags, "--", "true"],
            capture_output=True,
            text=True,
            env={"T": "x" * 32, "PATH": "/usr/bin:/bin"},
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert words in done.stderr
