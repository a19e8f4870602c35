"""``trainguard health-check``: the suite by hand, its table, its JSON, its exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from trainguard.cli import main
from trainguard.health.procfs import free_mib


def test_the_whole_suite_passes_here_as_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard.cli",
            "health-check",
            "--dir",
            str(tmp_path),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] is True
    outcomes = {check["name"]: check["outcome"] for check in report["checks"]}
    assert list(outcomes) == ["cpu", "memory", "disk", "shm", "gpu", "connectivity"]
    assert outcomes["disk"] == outcomes["cpu"] == outcomes["memory"] == "passed"
    assert outcomes["connectivity"] == "skipped"
    if shutil.which("nvidia-smi") is None:
        gpu = report["checks"][4]
        assert (gpu["outcome"], gpu["message"]) == ("skipped", "no CUDA device")
    assert report["counts"]["failed"] == 0
    assert list(tmp_path.iterdir()) == []


def test_a_failed_check_exits_1_and_the_table_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    too_much = str(int(free_mib(tmp_path) * 10) + 1024)
    code = main(
        ["health-check", "--check", "cpu,disk", "--dir", str(tmp_path), "--min-free-mib", too_much]
    )
    out = capsys.readouterr().out
    assert code == 1
    lines = out.splitlines()
    assert lines[0].split() == ["CHECK", "OUTCOME", "SECONDS", "MESSAGE"]
    assert lines[1].split()[:2] == ["cpu", "passed"]
    assert lines[2].split()[:2] == ["disk", "failed"]
    assert "too little free space" in lines[2]
    assert lines[-1] == "1 passed, 1 failed, 0 skipped"


def test_a_forced_failure_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["health-check", "--check", "memory", "--fail", "memory", "-o", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["checks"][0]["evidence"] == {"injected": True}


@pytest.mark.parametrize(
    "args",
    [
        ["--check", "gpus"],
        ["--expected-gpus", "-1"],
        ["--min-bandwidth", "fast"],
        ["-o", "yaml"],
        ["--check", "cpu", "--fail", "disk"],
    ],
)
def test_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        code = main(["health-check", *args])
        raise SystemExit(code)
    assert exited.value.code == 2
    assert capsys.readouterr().err
