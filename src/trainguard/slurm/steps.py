"""The steps a Slurm job's batch script starts, one per other node, each running a host
daemon that joins the job (``srun --nodes=1 ... trainguard run ... --rdzv-endpoint``).

A step that exits before its node joined is told at once, with its exit status and the
tail of its output (``srun: error: ...``, the daemon's own error), not discovered when
the join timeout runs out (:class:`~trainguard.platform.target.Joiners`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainguard.slurm.commands import node_step

__all__ = ["NodeSteps", "log_tail"]

STEP_EXIT_SECONDS = 30.0  # how long the nodes' steps get to end after the job
TAIL_LINES = 5  # of a step's output, in the sentence saying it exited
TAIL_BYTES = 4096


class NodeSteps:
    """One step per node in ``nodes``, each running ``argv``, its output in
    ``<logs>/step-<node>.log``."""

    def __init__(
        self, nodes: Sequence[str], argv: Sequence[str], env: Mapping[str, str], logs: Path
    ) -> None:
        self.logs = {node: logs / f"step-{node}.log" for node in nodes}
        self.steps = {node: node_step(node, argv, env, self.logs[node]) for node in nodes}
        self._told: set[str] = set()

    def exited(self) -> list[str]:
        """The steps that exited since the last look, each once, as a sentence."""
        lines = []
        for node, step in self.steps.items():
            if node in self._told or (code := step.poll()) is None:
                continue
            self._told.add(node)
            tail = log_tail(self.logs[node])
            lines.append(
                f"the Slurm step on {node} exited {code}"
                + (f": {tail}" if tail else " (no output)")
                + f" (log: {self.logs[node]})"
            )
        return lines

    def running(self) -> int:
        return sum(step.poll() is None for step in self.steps.values())

    def end(self) -> None:
        """The steps end with the job (their daemons learn it from their lease); any still
        running after :data:`STEP_EXIT_SECONDS` is signalled."""
        steps = list(self.steps.values())
        deadline = time.monotonic() + STEP_EXIT_SECONDS
        for step in steps:
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.wait(max(0.1, deadline - time.monotonic()))
        for step in steps:
            if step.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(step.pid, signal.SIGTERM)
        for step in steps:
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.wait(5.0)


def log_tail(path: Path) -> str:
    """The last few non-empty lines of a step's output, joined with `` | ``."""
    try:
        with path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = log.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-TAIL_LINES:])
