"""Where ``trainguard run`` (or ``resume``) runs a job: a typed target, given to
:class:`~trainguard.platform.local.LocalRunner` when it is built (one machine, the
controller's host of a job across hosts, a Slurm batch script, a Lost job resumed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from trainguard.hosts.controller_host import ControllerHost
from trainguard.platform.store import JobRow

__all__ = ["LOCAL", "Hosts", "Joiners", "Local", "Resume", "Slurm", "Target"]


class Joiners(Protocol):
    """The processes that are to join the job as hosts (a Slurm job's steps)."""

    def exited(self) -> list[str]:
        """Those that exited since the last look, each once, as a sentence (its exit
        status and the tail of its error)."""

    def running(self) -> int:
        """How many still run (each may yet hold one node)."""


@dataclass(frozen=True)
class Local:
    """Every node on this machine."""


@dataclass(frozen=True)
class Hosts:
    """The controller's host of a job across hosts."""

    controller: ControllerHost


@dataclass(frozen=True)
class Slurm:
    """The batch script of a Slurm job: the controller's host, the other nodes joining
    through ``joiners``. ``job_id`` is the same in every run of a requeued job, which
    carries on the record the run before left (``continue_record``); a stop takes at
    most ``stop_within`` seconds (SIGKILL follows ``scancel``); ``on_no_host`` is told of
    a node no host is left to run (the job then fails, and requeues itself)."""

    controller: ControllerHost
    job_id: str
    joiners: Joiners
    on_no_host: Callable[[str], None]
    continue_record: bool = False
    stop_within: float | None = None
    sigterm_reason: str = "cancelled by Slurm (SIGTERM: scancel, or the job's time limit)"


@dataclass(frozen=True)
class Resume:
    """A Lost job taken over; ``restart_blocked``: why it may not start new agents."""

    job: JobRow
    restart_blocked: str | None = None


Target = Local | Hosts | Slurm | Resume
LOCAL = Local()
