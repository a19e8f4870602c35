"""The controller's configuration from a job plan: one place for every platform."""

from __future__ import annotations

from trainguard.control.config import ControlConfig
from trainguard.control.elastic import ElasticConfig
from trainguard.control.persist import DurableCadence
from trainguard.control.policy import PolicyConfig
from trainguard.monitor.rules import LogRuleSpec
from trainguard.spec.model import HOSTS_NODE_LOST_AFTER_SECONDS
from trainguard.spec.plan import JobPlan, NodeGroupPlan
from trainguard.wire.logs import LogLimits

STUCK_RANK_SECONDS = 3.0
"""How long after an in-process restart a survivor may still be in the failed attempt."""
QUIET_POLL_SECONDS = 2.0
"""On one machine, while every rank trains and no timer is near: seconds between polls
(``pollIntervalSeconds`` when that is longer). Changes are pushed by the agents."""


def stuck_rank_timeout(barrier_timeout: float) -> float:
    """:data:`STUCK_RANK_SECONDS`, or half the barrier when that is shorter: a replaced
    rank must have time left to join."""
    return STUCK_RANK_SECONDS if barrier_timeout > STUCK_RANK_SECONDS else barrier_timeout / 2


def control_config(
    plan: JobPlan, job_id: str, *, durable: bool, hosts: bool = False, quiet_polls: bool = False
) -> tuple[ControlConfig, dict[str, tuple[int, NodeGroupPlan]]]:
    """The :class:`ControlConfig` of ``plan``, and each node id's group (index, plan).

    Node ids ``node-0..N-1`` run the job, in group order; each group's spare nodes follow
    them. ``durable``: the platform has a durable checkpoint tier, so the controller
    schedules persisting to it (``spec.checkpointing``'s cadence); ``hosts``: the job
    spans hosts (a node is lost only after ``nodeLostAfterSeconds`` of silence);
    ``quiet_polls``: the platform sees a dead agent without polling it (one machine: its
    process exits), so polls may be seldom while the job trains steadily
    (:data:`QUIET_POLL_SECONDS`).
    """
    groups: dict[str, tuple[int, NodeGroupPlan]] = {}
    active: list[str] = []
    spares: list[str] = []
    for index, group in enumerate(plan.groups):
        for _ in range(group.replicas):
            active.append(f"node-{len(active)}")
            groups[active[-1]] = (index, group)
    for index, group in enumerate(plan.groups):
        for _ in range(group.spares):
            spares.append(f"node-{len(active) + len(spares)}")
            groups[spares[-1]] = (index, group)
    spec = plan.job.spec
    elastic, growth = _elastic(plan, len(active) + len(spares), groups)
    run_policy = spec.run_policy
    checkpointing = spec.checkpointing
    options = spec.trainguard
    config = ControlConfig(
        job_id=job_id,
        node_ids=tuple(active),
        nproc_per_node=plan.nproc_per_node,
        policy=PolicyConfig.from_spec(run_policy, plan.max_restarts, plan.max_restarts_from),
        spare_node_ids=tuple(spares),
        log_rules=tuple(LogRuleSpec.from_model(r) for r in run_policy.log_monitoring_configuration),
        progress_pattern=options.progress_pattern,
        log_limits=LogLimits(
            max_bytes_per_rank=options.logs.max_bytes_per_rank, keep=options.logs.keep
        ),
        heartbeat_timeout=options.heartbeat_timeout_seconds,
        exit_hang_timeout=options.exit_hang_timeout_seconds,
        no_progress_timeout=options.no_progress_timeout_seconds,
        lost_after=lost_after(options.node_lost_after_seconds, hosts),
        stop_grace_seconds=plan.stop_grace_seconds,
        graceful_fault_stops=options.shutdown_signal == "SIGTERM",
        active_deadline_seconds=plan.active_deadline_seconds,
        durable=DurableCadence(
            checkpointing.durable_every_steps, checkpointing.durable_every_seconds
        )
        if durable
        else None,
        replicas=checkpointing.replicas,
        poll_interval=plan.poll_interval_seconds,
        quiet_poll_interval=max(plan.poll_interval_seconds, QUIET_POLL_SECONDS)
        if quiet_polls
        else None,
        node_start_timeout=plan.node_start_timeout_seconds,
        in_process=options.in_process_restart,
        hot_spares=options.hot_spares,
        barrier_timeout=options.restart_barrier_timeout_seconds,
        stuck_rank_timeout=stuck_rank_timeout(options.restart_barrier_timeout_seconds),
        straggler_threshold=options.straggler_threshold,
        straggler_window=options.straggler_window,
        straggler_action=options.straggler_action,
        elastic=elastic,
        elastic_node_ids=growth,
    )
    return config, groups


def lost_after(given: float | None, hosts: bool) -> float:
    """``nodeLostAfterSeconds``, or its default: none on one machine, 8 s across hosts."""
    if given is not None:
        return given
    return HOSTS_NODE_LOST_AFTER_SECONDS if hosts else 0.0


def fence_after(lost: float) -> float:
    """How long an agent goes on writing to the durable tier without a word from the
    controller: half the lost-node bound (agent/lease.py)."""
    return lost / 2


def _elastic(
    plan: JobPlan, first: int, groups: dict[str, tuple[int, NodeGroupPlan]]
) -> tuple[ElasticConfig | None, tuple[str, ...]]:
    """``spec.elasticPolicy`` as the controller's, and the node ids the job may grow onto
    (after the spares; each group up to its ``maxReplicas``, the rest to the last group)."""
    spec = plan.job.spec
    policy = spec.elastic_policy
    if policy is None:
        return None, ()
    total = plan.nnodes
    restart = spec.run_policy.restart_policy
    snooze = restart.scale_up_snooze_time_in_seconds if restart is not None else None
    config = ElasticConfig(
        min_nodes=policy.min_replicas or total,
        max_nodes=policy.max_replicas or total,
        increment=policy.replica_increment_step,
        discrete=tuple(policy.replica_discrete_values or ()),
        scaling_timeout=policy.scaling_timeout_in_seconds or 0.0,
        graceful_shutdown_timeout=policy.graceful_shutdown_timeout_in_seconds or 0.0,
        scale_up_snooze=snooze or 0.0,
        faulty_scale_down_timeout=policy.faulty_scale_down_timeout_in_seconds,
    )
    growth: list[str] = []
    extra = config.max_nodes - total
    for index, group in enumerate(plan.groups):
        room = (group.max_replicas or group.replicas) - group.replicas
        last = index == len(plan.groups) - 1
        for _ in range(extra - len(growth) if last else min(room, extra - len(growth))):
            growth.append(f"node-{first + len(growth)}")
            groups[growth[-1]] = (index, group)
    return config, tuple(growth)
