"""The ``connectivity`` check: an all-reduce between the job's nodes against a bandwidth floor.

HyperPod's ``InstanceConnectivity`` runs NCCL's all_reduce_perf across nodes; here every
node's agent runs this check at the same time, one process per node
(``python -m trainguard.health.bandwidth``, see there for what is measured), with the
same ``master_addr:master_port`` (rank 0's node hosts the rendezvous) and world size.
All ranks measure the same bus bandwidth (the slowest rank's time), so every node passes
or fails together; a node that does not come fails everyone's check at the timeout.

With ``world_size`` 1 there is nothing to measure: skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from trainguard.health.result import CheckResult, Evidence, Outcome
from trainguard.health.subproc import module_argv, run_bounded

__all__ = ["ConnectivityCheck", "judge_bandwidth"]

_STARTUP_S: Final = 5.0
"""Seconds of the timeout kept for the child's interpreter and torch import."""


@dataclass(frozen=True)
class ConnectivityCheck:
    """This node's rank in an all-reduce bandwidth test; fail under ``min_bandwidth_gbps``
    bus bandwidth (GB/s; 0: report only)."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    min_bandwidth_gbps: float = 0.0
    size_mib: float = 64
    backend: str = "auto"
    iterations: int = 5
    timeout: float = 120.0
    name: str = "connectivity"

    def run(self) -> CheckResult:
        if self.world_size < 2:
            return CheckResult(
                self.name, "skipped", "one node: no peers to measure the bandwidth to"
            )
        argv = module_argv(
            "trainguard.health.bandwidth",
            f"--rank={self.rank}",
            f"--world-size={self.world_size}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            f"--size-mib={self.size_mib:g}",
            f"--backend={self.backend}",
            f"--iterations={self.iterations}",
            f"--timeout={max(self.timeout - _STARTUP_S, 1.0):g}",
        )
        done = run_bounded(argv, self.timeout)
        evidence: Evidence = {
            "world_size": self.world_size,
            "master": f"{self.master_addr}:{self.master_port}",
            "min_bandwidth_gbps": self.min_bandwidth_gbps,
        }
        if done.timed_out:
            message = f"all-reduce test timed out after {self.timeout:g} s (a peer missing?)"
            return CheckResult(self.name, "failed", message, evidence)
        answer = done.answer()
        if answer is None or "error" in answer:
            reason = answer["error"] if answer else f"exit {done.returncode}: {done.tail()}"
            return CheckResult(self.name, "failed", f"all-reduce test failed: {reason}", evidence)
        for key in ("backend", "size_mib", "seconds_per_op", "algbw_gbps", "busbw_gbps"):
            evidence[key] = answer.get(key)
        if not answer.get("correct", False):
            return CheckResult(self.name, "failed", "all-reduce returned wrong sums", evidence)
        busbw = float(answer.get("busbw_gbps") or 0.0)
        outcome, message = judge_bandwidth(busbw, self.min_bandwidth_gbps)
        detail = f"{message} ({answer.get('backend')}, {self.world_size} nodes)"
        return CheckResult(self.name, outcome, detail, evidence)


def judge_bandwidth(busbw_gbps: float, min_gbps: float) -> tuple[Outcome, str]:
    """("passed" | "failed", message) of a measured bus bandwidth against its floor."""
    if busbw_gbps < min_gbps:
        return "failed", (
            f"all-reduce bus bandwidth too low: expected minimum {min_gbps:g} GB/s, "
            f"got {busbw_gbps:.3g}"
        )
    return "passed", f"all-reduce bus bandwidth {busbw_gbps:.3g} GB/s"
