"""A Slurm job's batch script and the steps that join it, without Slurm: ``srun`` is a
stand-in script on ``PATH``. A step that exits before its node joined is told at once,
with its exit status and error, and the job fails (no node is left to hold it) instead
of waiting out the join timeout. The real thing is tests/test_slurm_platform.py."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from conftest import FAKE_WORKER
from trainguard.control.actions import JobPhase
from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.controller_host import ControllerHost
from trainguard.platform.local import LocalRunner
from trainguard.platform.procs import free_port
from trainguard.platform.store import open_store
from trainguard.platform.target import Slurm
from trainguard.slurm.steps import NodeSteps
from trainguard.spec import cli_job, resolve_plan

SRUN_ERROR = "srun: error: Unable to create step for job 7: Invalid generic resource"


def test_a_step_that_exits_before_joining_is_told_at_once_and_fails_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/sh\necho '{SRUN_ERROR}' >&2\nexit 1\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    plan = resolve_plan(cli_job(str(FAKE_WORKER), [], 2, 1, 0), "test")
    store = open_store(tmp_path / "state")
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = NodeSteps(["n1"], ["trainguard", "run"], os.environ, logs)
    endpoint = JobEndpoint("127.0.0.1", free_port("127.0.0.1"))
    # A join timeout the test would notice (a wait for it fails the asserts below).
    controller = ControllerHost(endpoint, LocalAddress("127.0.0.1", "lo"), "t" * 32, 120.0, 30.0)
    said = io.StringIO()
    target = Slurm(controller, "job-slurm7", steps, lambda node: None)
    try:
        result = LocalRunner(plan, store, "test", out=said, err=said, target=target).run()
    finally:
        steps.end()
        store.close()
    assert result.phase is JobPhase.FAILED, said.getvalue()
    assert "the Slurm step on n1 exited 1" in result.reason, result.reason
    assert SRUN_ERROR in result.reason and "--join-timeout" not in result.reason
    assert f"the Slurm step on n1 exited 1: {SRUN_ERROR}" in said.getvalue()
