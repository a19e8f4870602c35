"""A Slurm allocation as trainguard sees it: from the environment Slurm gives a job.

Pure but for :func:`expand_nodelist`, which asks ``scontrol show hostnames`` (Slurm's own
expansion of ``node[0-3,7]``: the one source of truth for its syntax).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Allocation", "SlurmError", "expand_nodelist", "in_allocation", "spare_count"]


class SlurmError(RuntimeError):
    """A Slurm command failed, or the allocation cannot run the job (the message says)."""


@dataclass(frozen=True)
class Allocation:
    """The job's allocation: its id, its nodes (in Slurm's order), this process's node,
    and how many times Slurm requeued it."""

    job_id: str
    nodes: tuple[str, ...]
    this_node: str
    restart_count: int = 0
    # Set in a task of a step (``srun trainguard run ...`` on every node), not in the
    # batch script: the task's node index and how many nodes the step spans.
    step_node: int | None = None
    step_nodes: int | None = None

    @property
    def in_step(self) -> bool:
        """Run by ``srun`` on every node (torchrun's habit), not by the batch script."""
        return self.step_node is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Allocation:
        environ = os.environ if env is None else env
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise SlurmError("not in a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST)")
        nodes = expand_nodelist(nodelist, environ)
        this = environ.get("SLURMD_NODENAME") or nodes[0]
        step = environ.get("SLURM_STEP_ID")
        in_step = step is not None and step not in ("batch", "extern", "interactive")
        return cls(
            job_id=job_id,
            nodes=nodes,
            this_node=this,
            restart_count=_int(environ.get("SLURM_RESTART_COUNT"), 0),
            step_node=_int(environ.get("SLURM_NODEID"), 0) if in_step else None,
            step_nodes=_int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES"), 0)
            if in_step
            else None,
        )


def in_allocation(env: Mapping[str, str] | None = None) -> bool:
    environ = os.environ if env is None else env
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def expand_nodelist(nodelist: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``node[0-2]`` -> ``(node0, node1, node2)``, by ``scontrol show hostnames``."""
    try:
        done = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=dict(os.environ if env is None else env),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"scontrol show hostnames {nodelist}: {exc}") from None
    if done.returncode != 0:
        raise SlurmError(f"scontrol show hostnames {nodelist}: {done.stderr.strip()}")
    nodes = tuple(line.strip() for line in done.stdout.splitlines() if line.strip())
    if not nodes:
        raise SlurmError(f"the allocation's node list {nodelist!r} names no node")
    return nodes


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def spare_count(job_nodes: int, job_spares: int, allocated: int) -> int:
    """The spares a job has in an allocation of ``allocated`` nodes: the spec's, or every
    node beyond the job's when there are more."""
    return max(job_spares, allocated - job_nodes)
