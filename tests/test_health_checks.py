"""On-start checks on this machine: they pass, fail on their thresholds, and the runner
bounds them (timeouts, exceptions, injected failures)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainguard.health import (
    CheckResult,
    CpuCheck,
    DirectoryCheck,
    GpuCheck,
    MemoryCheck,
    SuiteConfig,
    on_start_checks,
    run_checks,
    shm_check,
)
from trainguard.health.gpu import judge_dcgm, judge_probe
from trainguard.health.procfs import free_mib, parse_meminfo, parse_psi
from trainguard.health.subproc import run_bounded


@dataclass(frozen=True)
class Sleepy:
    """A check that takes ``seconds``, or raises."""

    seconds: float
    timeout: float
    name: str = "sleepy"
    boom: bool = False

    def run(self) -> CheckResult:
        if self.boom:
            raise RuntimeError("sensor on fire")
        time.sleep(self.seconds)
        return CheckResult(self.name, "passed", "slept")


def test_cpu_memory_disk_and_shm_pass_here(tmp_path: Path) -> None:
    checks = [
        CpuCheck(seconds=0.2),
        MemoryCheck(mib=16),
        DirectoryCheck(str(tmp_path), min_free_mib=1, write_mib=2),
        shm_check(min_free_mib=1, write_mib=1),
    ]
    results = run_checks(checks)
    assert [r.name for r in results] == ["cpu", "memory", "disk", "shm"]
    by_name = {r.name: r for r in results}
    assert by_name["cpu"].outcome == "passed"
    assert isinstance(by_name["cpu"].evidence["mb_per_s"], float)
    assert by_name["cpu"].evidence["mb_per_s"] > 0
    assert 0.15 < by_name["cpu"].seconds < 5
    assert by_name["memory"].outcome == "passed"
    assert by_name["memory"].evidence["mem_available_mib"] is not None
    assert by_name["disk"].outcome == "passed", by_name["disk"].message
    assert by_name["disk"].evidence["written_mib"] == 2
    assert list(tmp_path.iterdir()) == []  # the test file is gone
    expected_shm = "passed" if os.path.isdir("/dev/shm") else "skipped"
    assert by_name["shm"].outcome == expected_shm


def test_thresholds_above_what_the_machine_has_fail(tmp_path: Path) -> None:
    free = free_mib(tmp_path)
    disk, cpu, memory = run_checks(
        [
            DirectoryCheck(str(tmp_path), min_free_mib=free * 10 + 1024),
            CpuCheck(seconds=0.1, min_mb_per_s=1e12),
            MemoryCheck(mib=1, min_available_mib=1e12),
        ]
    )
    assert disk.outcome == "failed"
    assert "expected minimum" in disk.message
    assert cpu.outcome == "failed"
    assert "expected minimum" in cpu.message
    assert memory.outcome == "failed"
    assert "too little memory" in memory.message


def test_a_missing_directory_fails_disk_and_skips_shm(tmp_path: Path) -> None:
    gone = str(tmp_path / "nope")
    disk, shm = run_checks(
        [DirectoryCheck(gone), DirectoryCheck(gone, skip_if_missing=True, name="shm")]
    )
    assert (disk.outcome, shm.outcome) == ("failed", "skipped")
    assert gone in disk.message


def test_a_directory_that_takes_no_files_fails() -> None:
    (result,) = run_checks([DirectoryCheck("/proc", min_free_mib=0)])  # even root cannot
    assert result.outcome == "failed"
    assert "/proc/.trainguard-health-" in result.message


def test_a_check_over_its_timeout_fails_saying_so() -> None:
    start = time.monotonic()
    (result,) = run_checks([Sleepy(seconds=30, timeout=0.2)])
    assert time.monotonic() - start < 5
    assert result.outcome == "failed"
    assert "timed out" in result.message
    assert result.evidence["timeout_s"] == 0.2


def test_a_check_that_raises_fails_with_the_error() -> None:
    (result,) = run_checks([Sleepy(seconds=0, timeout=5, boom=True)])
    assert result.outcome == "failed"
    assert "sensor on fire" in result.message


def test_a_forced_failure_does_not_run_the_check_and_says_it_was_injected() -> None:
    slow, other = run_checks(
        [Sleepy(seconds=30, timeout=60), Sleepy(seconds=0, timeout=5, name="other")],
        fail={"sleepy"},
    )
    assert slow.outcome == "failed"
    assert "injection" in slow.message
    assert slow.evidence == {"injected": True}
    assert slow.seconds < 1
    assert other.outcome == "passed"


def test_forcing_an_unknown_check_is_an_error() -> None:
    with pytest.raises(ValueError, match="no health check named 'dsik'"):
        run_checks([Sleepy(seconds=0, timeout=1)], fail={"dsik"})


def test_a_bounded_child_is_killed_at_its_timeout() -> None:
    start = time.monotonic()
    done = run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert done.timed_out
    assert time.monotonic() - start < 5


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine")
def test_the_gpu_check_is_skipped_without_a_gpu() -> None:
    (result,) = run_checks([GpuCheck(dcgmi=None, timeout=60)])
    assert result.outcome == "skipped", result.message
    assert result.message == "no CUDA device"
    assert result.evidence["device_count"] == 0


def test_the_probes_answer_is_judged_against_the_expected_count() -> None:
    good = {"index": 0, "name": "H100", "matmul_error": 1e-6, "tflops": 50.0, "pattern_ok": True}
    two = {"torch": True, "cuda": True, "device_count": 2, "devices": [good, good | {"index": 1}]}
    assert judge_probe(two, expected_gpus=2).outcome == "passed"
    short = judge_probe(two, expected_gpus=8)
    assert (short.outcome, short.message) == ("failed", "GPU count: expected 8, got 2")
    wrong = two | {"devices": [good, good | {"index": 1, "matmul_error": 0.5}]}
    assert judge_probe(wrong, None).message.startswith("GPU 1: matmul result off")
    flaky = two | {"devices": [good | {"pattern_ok": False}, good]}
    assert "memory pattern" in judge_probe(flaky, None).message
    none = {"torch": True, "cuda": False, "device_count": 0}
    assert judge_probe(none, None).outcome == "skipped"
    assert judge_probe(none, 8).message == "GPU count: expected 8, got 0 (no CUDA device)"
    assert judge_probe({"torch": False, "error": "No module"}, None).outcome == "skipped"


def test_dcgm_diag_output_is_judged() -> None:
    table = "| Denylist | Pass |\n| PCIe | Fail - GPU 0 link degraded |\n"
    failed = judge_dcgm(226, table, 60)
    assert failed is not None
    assert failed.outcome == "failed"
    assert "link degraded" in failed.message
    passed = judge_dcgm(0, "| Denylist | Pass |\n", 60)
    assert passed is not None and passed.outcome == "passed"
    assert judge_dcgm(1, "Error: unable to establish a connection to the host engine", 60) is None
    timed_out = judge_dcgm(None, "", 60)
    assert timed_out is not None and "timed out" in timed_out.message


def test_a_failing_dcgmi_fails_the_gpu_check(tmp_path: Path) -> None:
    dcgmi = tmp_path / "dcgmi"
    dcgmi.write_text("#!/bin/sh\necho '| Memory | Fail - GPU 3 |'\nexit 226\n")
    dcgmi.chmod(0o755)
    (result,) = run_checks([GpuCheck(dcgmi=str(dcgmi), timeout=10)])
    assert result.outcome == "failed"
    assert "GPU 3" in result.message


def test_the_suite_has_every_check_and_aliases_expand(tmp_path: Path) -> None:
    names = [c.name for c in on_start_checks(SuiteConfig(), str(tmp_path))]
    assert names == ["cpu", "memory", "disk", "shm", "gpu", "connectivity"]
    stress = on_start_checks(SuiteConfig(checks=("InstanceStress",)), str(tmp_path))
    assert "connectivity" not in [c.name for c in stress]
    with pytest.raises(ValueError, match="unknown health check 'gpus'"):
        SuiteConfig(checks=("gpus",))


def test_proc_files_parse() -> None:
    meminfo = parse_meminfo("MemTotal:  1000 kB\nMemAvailable:   512 kB\nHugePages_Total: 0\n")
    assert meminfo == {"MemTotal": 1024000, "MemAvailable": 524288, "HugePages_Total": 0}
    psi = parse_psi("some avg10=1.50 avg60=0.20 avg300=0.00 total=12\n\nfull avg10=0.5 bad\n")
    assert psi["some"]["avg10"] == 1.5
    assert psi["full"] == {"avg10": 0.5}
