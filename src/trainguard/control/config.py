"""Everything the controller knows about a job, with every threshold it decides by.

The platform builds a :class:`ControlConfig` from the job plan
(:func:`trainguard.platform.control_config.control_config`); the controller and the pure
decision functions of this package read their parameters from it and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.control.contact import ContactRule
from trainguard.control.elastic import ElasticConfig
from trainguard.control.exit_hang import DEFAULT_TIMEOUT as DEFAULT_EXIT_HANG_TIMEOUT
from trainguard.control.no_progress import DEFAULT_TIMEOUT as DEFAULT_NO_PROGRESS_TIMEOUT
from trainguard.control.persist import DurableCadence
from trainguard.control.policy import PolicyConfig
from trainguard.control.stragglers import (
    DEFAULT_ACTION,
    DEFAULT_THRESHOLD,
    DEFAULT_WINDOW,
    MAX_WINDOW,
    StragglerAction,
)
from trainguard.monitor.rules import LogRuleSpec
from trainguard.wire.logs import LogLimits
from trainguard.wire.requests import MonitorConfig

__all__ = ["ControlConfig"]


@dataclass(frozen=True)
class ControlConfig:
    """A job as the controller sees it, and every threshold it decides by (seconds)."""

    job_id: str
    node_ids: tuple[str, ...]
    nproc_per_node: int
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig.from_spec(None, 0))
    spare_node_ids: tuple[str, ...] = ()
    log_rules: tuple[LogRuleSpec, ...] = ()
    progress_pattern: str | None = None
    # How much of each rank's output the agents keep on disk (spec.trainguard.logs).
    log_limits: LogLimits = field(default_factory=LogLimits)
    heartbeat_timeout: float | None = None
    # A rank still running this long (or 20 mean steps, if longer) after every other rank
    # exited 0, idle, is an ExitHang (control/exit_hang.py); None: never.
    exit_hang_timeout: float | None = DEFAULT_EXIT_HANG_TIMEOUT
    # A job that showed progress and shows none for this long (or 10 mean steps, if
    # longer) is hung: NoProgress (control/no_progress.py); None: never.
    no_progress_timeout: float | None = DEFAULT_NO_PROGRESS_TIMEOUT
    extra_env: dict[str, str] = field(default_factory=dict)
    active_deadline_seconds: float | None = None

    # -- the loop and what a node's silence means --------------------------------
    # How often the platform polls every agent (pushes wake the loop sooner).
    poll_interval: float = 0.5
    # While every rank trains and no timer of the attempt is near, it polls this seldom
    # instead (None: always ``poll_interval``); agents still push every change at once
    # (JobController.pace). Across hosts the polls are the liveness check: None there.
    quiet_poll_interval: float | None = None
    # A launched node's agent must answer within this long, or the node is lost.
    node_start_timeout: float = 60.0
    # A node no host can run yet (a job across hosts whose host was lost, and no spare):
    # how long its launch waits for a host to join or rejoin (--join-timeout, as
    # torchrun's rendezvous waits for its nodes); 0: it is lost at once.
    host_wait: float = 0.0
    # Consecutive failed contacts (status polls or requests) after which a node that
    # answered before is lost; one failure is evidence, not a verdict.
    unreachable_after: int = 3
    # ... and the seconds it must have been silent by then (across hosts: longer than its
    # agent's fence, agent/lease.py; 0: the count alone decides).
    lost_after: float = 0.0

    # -- stopping ---------------------------------------------------------------------
    stop_grace_seconds: float = 10.0
    # A fault's stop: SIGTERM and the grace too (shutdownSignal SIGTERM), not SIGKILL now.
    graceful_fault_stops: bool = False
    # Extra time, beyond the grace period, that nodes get to report a stop.
    stop_slack_seconds: float = 15.0

    # -- checkpoints --------------------------------------------------------------------
    # When to persist checkpoints to the durable tier (None: never; the agents write).
    durable: DurableCadence | None = None
    # After the last rank exits 0: how long to wait for its newest checkpoint to be durable.
    final_persist_timeout: float = 120.0
    # Memory-tier replicas: each node pushes its snapshots to this many next nodes.
    replicas: int = 0

    # Elastic training (control/elastic.py): the sizes the job may run at, and the node
    # ids it grows onto beyond `node_ids` (None: a fixed size).
    elastic: ElasticConfig | None = None
    elastic_node_ids: tuple[str, ...] = ()

    # A node relaunched with the same id lands on another machine (Kubernetes: a fresh pod,
    # kept off Nodes labelled unhealthy): an unhealthy node with no spare left to replace
    # it restarts fresh. False (one machine): it cannot, and the job fails instead.
    fresh_node_moves: bool = False

    # -- in-process restarts (the script adopts trainguard.resilient) -------------------
    in_process: bool = False
    # Hot spare processes for the whole job, spread over the nodes from node 0.
    hot_spares: int = 0
    # How long every rank has to rejoin after an in-process restart.
    barrier_timeout: float = 60.0
    # A survivor that has neither left the failed attempt nor joined the new one this
    # long after the restart is deadlocked in a collective: it is replaced in place.
    stuck_rank_timeout: float = 3.0

    # -- stragglers (control/stragglers.py) ------------------------------------------
    # A rank whose seconds per step over its last `straggler_window` steps reach this
    # many times the job's median is a straggler (None: paces measured, none reported).
    straggler_threshold: float | None = DEFAULT_THRESHOLD
    straggler_window: int = DEFAULT_WINDOW
    # "report": an event; "restart": also a fault, and its node is replaced.
    straggler_action: StragglerAction = DEFAULT_ACTION

    @property
    def contact_rule(self) -> ContactRule:
        """When a silent node is lost: the one rule the controller and the platforms use."""
        return ContactRule(self.unreachable_after, self.lost_after)

    def __post_init__(self) -> None:
        if not self.node_ids:
            raise ValueError("node_ids: a job needs at least one node")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node: must be >= 1, got {self.nproc_per_node}")
        if self.unreachable_after < 1:
            raise ValueError(f"unreachable_after: must be >= 1, got {self.unreachable_after}")
        for name in (
            "poll_interval",
            "node_start_timeout",
            "stop_grace_seconds",
            "stop_slack_seconds",
            "final_persist_timeout",
            "barrier_timeout",
            "stuck_rank_timeout",
            "lost_after",
            "host_wait",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        quiet = self.quiet_poll_interval
        if quiet is not None and not (math.isfinite(quiet) and quiet >= self.poll_interval):
            raise ValueError(
                f"quiet_poll_interval: must be a finite number >= poll_interval "
                f"({self.poll_interval:g}), got {quiet!r}"
            )
        for name in ("exit_hang_timeout", "no_progress_timeout"):
            bound = getattr(self, name)
            if bound is not None and not (math.isfinite(bound) and bound > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {bound!r}")
        threshold = self.straggler_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold > 1):
            raise ValueError(f"straggler_threshold: must be a finite number > 1, got {threshold!r}")
        window = self.straggler_window
        if isinstance(window, bool) or not 2 <= window <= MAX_WINDOW:
            raise ValueError(f"straggler_window: must be in [2, {MAX_WINDOW}], got {window!r}")
        if self.straggler_action not in ("report", "restart"):
            raise ValueError(
                f"straggler_action: must be report or restart, got {self.straggler_action!r}"
            )
        if self.stuck_rank_timeout >= self.barrier_timeout and self.in_process:
            raise ValueError(
                f"stuck_rank_timeout ({self.stuck_rank_timeout:g} s) must be shorter than "
                f"barrier_timeout ({self.barrier_timeout:g} s): a stuck rank is replaced "
                "within the barrier"
            )

    @property
    def world_size(self) -> int:
        return len(self.node_ids) * self.nproc_per_node

    @property
    def max_restarts(self) -> int:
        return self.policy.job_max_retry_count

    def monitor(self) -> MonitorConfig:
        """What each agent needs to match log lines (sent with every attempt)."""
        return MonitorConfig(
            log_rules=tuple(r.to_json() for r in self.log_rules),
            progress_pattern=self.progress_pattern,
            logs=self.log_limits,
        )
