"""The ``gpu`` check: DCGM diagnostics where installed, else a CUDA test; the GPU count.

1. With ``dcgmi`` on PATH: ``dcgmi diag -r <level>`` (level 1 by default: seconds; 3
   and 4 take many minutes and need a longer ``timeout``). A non-zero exit or a
   ``Fail`` in its table fails the check. Where dcgmi cannot reach its host engine
   (``nv-hostengine`` not running), the CUDA test below runs instead and the evidence
   says so.
2. Else, or after a passing diag when ``expected_gpus`` is set, the probe
   (``python -m trainguard.health.gpu_probe``, a child process: the agent does not
   import torch) tests each device: a matmul against the CPU's result, a memory
   pattern test, and counts the devices.
3. No CUDA device: skipped ("no CUDA device"), unless ``expected_gpus`` > 0, which
   fails it (the GPUs the node should have are missing).

The count fails only when lower than expected: a node with more GPUs than the spec
says is odd, but not broken.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Final

from trainguard.health.result import CheckResult, Evidence, JsonValue
from trainguard.health.subproc import module_argv, run_bounded

__all__ = ["MAX_MATMUL_ERROR", "GpuCheck", "judge_dcgm", "judge_probe"]

MAX_MATMUL_ERROR: Final = 1e-3
"""Largest relative difference between a float32 matmul on the GPU and on the CPU."""

_DCGM_FAIL: Final = re.compile(r"\|\s*Fail\b.*", re.IGNORECASE)
_DCGM_UNREACHABLE: Final = re.compile(
    r"host engine|unable to (?:establish a )?connect|connection refused", re.IGNORECASE
)


def _which_dcgmi() -> str | None:
    return shutil.which("dcgmi")


@dataclass(frozen=True)
class GpuCheck:
    """DCGM diag or a CUDA matmul and memory test; the count against ``expected_gpus``."""

    expected_gpus: int | None = None
    dcgmi: str | None = field(default_factory=_which_dcgmi)
    dcgm_level: int = 1
    matmul_size: int = 2048
    pattern_mib: int = 256
    timeout: float = 120.0
    name: str = "gpu"

    def run(self) -> CheckResult:
        deadline = time.monotonic() + self.timeout
        evidence: Evidence = {"expected_gpus": self.expected_gpus}
        count_only = False
        if self.dcgmi is not None:
            argv = [self.dcgmi, "diag", "-r", str(self.dcgm_level)]
            done = run_bounded(argv, self.timeout)
            verdict = judge_dcgm(done.returncode, done.stdout + done.stderr, self.timeout)
            if verdict is None:
                evidence["dcgm"] = "host engine unreachable; CUDA test instead"
            else:
                evidence["dcgm"] = verdict.message
                if verdict.failed or self.expected_gpus is None:
                    return CheckResult(self.name, verdict.outcome, verdict.message, evidence)
                count_only = True
        args = [f"--matmul-size={self.matmul_size}", f"--pattern-mib={self.pattern_mib}"]
        if count_only:
            args.append("--count-only")
        remaining = max(deadline - time.monotonic(), 1.0)
        done = run_bounded(module_argv("trainguard.health.gpu_probe", *args), remaining)
        if done.timed_out:
            return CheckResult(
                self.name, "failed", f"GPU test timed out after {self.timeout:g} s", evidence
            )
        answer = done.answer()
        if answer is None:
            message = f"GPU test gave no answer (exit {done.returncode}): {done.tail()}"
            return CheckResult(self.name, "failed", message, evidence)
        result = judge_probe(answer, self.expected_gpus)
        return CheckResult(self.name, result.outcome, result.message, evidence | result.evidence)


def judge_dcgm(returncode: int | None, output: str, timeout: float) -> CheckResult | None:
    """dcgmi diag's verdict, or None where it could not reach its host engine."""
    if returncode is None:
        return CheckResult("gpu", "failed", f"dcgmi diag timed out after {timeout:g} s")
    failing = _DCGM_FAIL.search(output)
    if returncode != 0 and failing is None and _DCGM_UNREACHABLE.search(output):
        return None
    if returncode != 0 or failing is not None:
        detail = failing.group(0).strip(" |") if failing else _last_line(output)
        return CheckResult("gpu", "failed", f"dcgmi diag failed (exit {returncode}): {detail}")
    return CheckResult("gpu", "passed", "dcgmi diag passed")


def judge_probe(answer: dict[str, Any], expected_gpus: int | None) -> CheckResult:
    """The probe's answer (see `trainguard.health.gpu_probe`) against the expected count."""
    expected = expected_gpus or 0
    if answer.get("error") and not answer.get("torch"):
        reason = f"torch is not importable ({answer['error']})"
        if expected > 0:
            return CheckResult("gpu", "failed", f"expected {expected} GPUs, cannot test: {reason}")
        return CheckResult("gpu", "skipped", f"no CUDA test: {reason}")
    if answer.get("error"):
        return CheckResult("gpu", "failed", f"GPU test failed: {answer['error']}")
    count = int(answer.get("device_count") or 0)
    evidence: Evidence = {"device_count": count}
    if count == 0:
        if expected > 0:
            message = f"GPU count: expected {expected}, got 0 (no CUDA device)"
            return CheckResult("gpu", "failed", message, evidence)
        return CheckResult("gpu", "skipped", "no CUDA device", evidence)
    if count < expected:
        message = f"GPU count: expected {expected}, got {count}"
        return CheckResult("gpu", "failed", message, evidence)
    devices = answer.get("devices")
    if not isinstance(devices, list):
        return CheckResult("gpu", "passed", f"{count} GPU(s) visible (count only)", evidence)
    evidence["devices"] = [_entry(device) for device in devices]
    for device in devices:
        problem = _device_problem(device)
        if problem:
            return CheckResult("gpu", "failed", f"GPU {device.get('index')}: {problem}", evidence)
    slowest = min(float(device.get("tflops", 0.0)) for device in devices)
    message = f"{count} GPU(s): matmul and memory pattern OK (slowest {slowest:g} TFLOP/s fp32)"
    return CheckResult("gpu", "passed", message, evidence)


def _device_problem(device: dict[str, Any]) -> str | None:
    if device.get("error"):
        return str(device["error"])
    error = float(device.get("matmul_error", 0.0))
    if error > MAX_MATMUL_ERROR:
        return f"matmul result off by {error:.2e} (relative; at most {MAX_MATMUL_ERROR:g})"
    if not device.get("pattern_ok", False):
        return "memory pattern test read back wrong values"
    return None


def _entry(device: dict[str, Any]) -> JsonValue:
    keys = ("index", "name", "matmul_error", "tflops", "pattern_ok", "error")
    return {key: device[key] for key in keys if key in device}


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
