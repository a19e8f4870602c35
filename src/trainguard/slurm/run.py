"""``trainguard run`` inside a Slurm allocation.

Two ways, both on top of :mod:`trainguard.hosts` (the same job on several hosts):

- **in the batch script** (``trainguard run -f job.yaml`` in an ``sbatch`` script): this
  process, on the allocation's first node, runs the controller and node 0; every other
  node of the allocation gets a step of its own (``srun --nodes=1 --no-kill --overlap``)
  running the same command with ``--rdzv-endpoint`` pointing here, which joins as a
  host. The nodes beyond the job's replicas are its spares. A node lost or found
  unhealthy is drained (``scontrol update ... state=drain reason="trainguard: ..."``);
  when the allocation can no longer hold the job (a node must be replaced and no node is
  left), the job requeues itself (``scontrol requeue``, at most ``maxRequeues`` times,
  counted by ``SLURM_RESTART_COUNT``) and the run that follows resumes it under the same
  job id, from its newest durable checkpoint. ``scancel`` stops every rank gracefully.
- **on every node** (``srun trainguard run ...``, torchrun's habit): the endpoint is the
  allocation's first node, each node's rank its ``SLURM_NODEID``; the token must be in
  ``$TRAINGUARD_TOKEN`` (the same on every node).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Sequence

from trainguard.control.events import Event, EventKind, FaultType
from trainguard.hosts.addresses import JobEndpoint, LocalAddress, resolve, route_to
from trainguard.hosts.controller_host import ControllerHost
from trainguard.hosts.run import say
from trainguard.hosts.security import TOKEN_ENV, TokenError, client_tls, server_tls
from trainguard.platform.launch import EXIT_USAGE, JobToRun, launch
from trainguard.platform.local import MEMORY_ROOT
from trainguard.platform.procs import free_port
from trainguard.platform.target import Slurm
from trainguard.slurm.allocation import Allocation, SlurmError
from trainguard.slurm.commands import drain, kill_wait, requeue
from trainguard.slurm.steps import NodeSteps
from trainguard.spec.plan import JobPlan

__all__ = ["DRAINED_FAULTS", "daemon_argv", "in_step_endpoint", "run_in_allocation"]

KILL_WAIT_MARGIN = 3.0  # of Slurm's KillWait, kept for the controller to record the stop
DRAINED_FAULTS = frozenset(
    {FaultType.NODE_LOST, FaultType.NODE_UNHEALTHY, FaultType.HEALTH_CHECK_FAILED}
)
"""Faults that drain the node (a lost machine, a failed check, an XID)."""


CONTROLLER_ONLY = frozenset({"inject", "metrics_port", "metrics_host", "metrics_linger"})
"""The ``trainguard run`` options (by ``dest``) only the controller's host takes."""


def daemon_argv(
    argv: Sequence[str], endpoint: JobEndpoint, parser: argparse.ArgumentParser
) -> list[str]:
    """The command the other nodes run: ``argv`` (this one, as ``parser`` reads it)
    without the options only the controller's host takes, joined to ``endpoint``; the
    script's own arguments as they were. Where the options end is the parser's word (a
    value-taking flag, an abbreviation, ``--flag=value``, ``-fFILE``), not a list kept
    by hand."""
    args, _ = parser.parse_known_args(argv)
    split = len(argv) - (len(args.script_args) + 1 if args.script else 0)
    run = _run_parser(parser)
    head: list[str] = []
    skip = False
    for arg in argv[:split]:
        if skip:
            skip = False
            continue
        action, attached = _option(run, arg)
        if action is not None and action.dest in CONTROLLER_ONLY:
            skip = not attached and action.nargs != 0
            continue
        head.append(arg)
    return [*head, "--rdzv-endpoint", str(endpoint), *argv[split:]]


def _run_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            run: argparse.ArgumentParser = action.choices["run"]
            return run
    raise KeyError("run")


def _option(run: argparse.ArgumentParser, arg: str) -> tuple[argparse.Action | None, bool]:
    """The option ``arg`` names as argparse reads it (an exact name, a unique prefix of
    a long one, ``--name=value``, ``-fVALUE``), and whether its value is attached."""
    if not arg.startswith("-") or arg == "-":
        return None, False
    options = run._option_string_actions
    name, eq, _ = arg.partition("=")
    if name in options:
        return options[name], bool(eq)
    if arg.startswith("--"):
        found = [a for o, a in options.items() if o.startswith(name) and o.startswith("--")]
        return (found[0], bool(eq)) if len({id(a) for a in found}) == 1 else (None, False)
    return options.get(arg[:2]), len(arg) > 2


def run_in_allocation(
    args: argparse.Namespace, job: JobToRun, argv: Sequence[str], parser: argparse.ArgumentParser
) -> int:
    """The batch script's ``trainguard run`` (see the module doc); ``argv``: its own
    command line as ``parser`` reads it, which the other nodes run too."""
    plan = job.plan
    try:
        alloc = Allocation.from_env()
        tls_server = server_tls(args.tls_cert, args.tls_key)
        tls_client = client_tls(args.tls_ca, args.tls_cert)
    except (SlurmError, TokenError) as exc:
        say(str(exc))
        return EXIT_USAGE
    if len(alloc.nodes) < plan.nnodes:
        say(
            f"the job needs {plan.nnodes} nodes (spec.replicaSpecs) and the allocation has "
            f"{len(alloc.nodes)} (SLURM_JOB_NODELIST: {', '.join(alloc.nodes)})"
        )
        return EXIT_USAGE
    token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
    os.environ[TOKEN_ENV] = token  # the steps' environment: never their command line
    others = [n for n in alloc.nodes if n != alloc.this_node]
    local = route_to(resolve(others[0])) if others else LocalAddress("127.0.0.1", "lo")
    endpoint = JobEndpoint(local.addr, free_port(local.addr))
    partition = plan.job.spec.trainguard.partition_timeout_seconds
    hosts = ControllerHost(
        endpoint, local, token, args.join_timeout, partition, tls_server, tls_client,
        args.tls_ca if tls_server is not None else None,
    )  # fmt: skip
    job_id = f"{plan.name}-slurm{alloc.job_id}"
    if alloc.restart_count == 0:  # a tier by this name is another job's (ids wrap, reinstalls)
        shutil.rmtree(MEMORY_ROOT / job_id, ignore_errors=True)
    if plan.job.spec.trainguard.drain_nodes:
        hosts.listeners.append(_drainer(hosts))
    logs = job.store.root / "jobs" / job_id / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    steps_argv = [sys.executable, "-m", "trainguard.cli", *daemon_argv(argv, endpoint, parser)]
    say(
        f"Slurm job {alloc.job_id}: controller and node 0 on {alloc.this_node}; "
        f"{len(others)} more nodes join through their own steps"
        + (f" (requeued {alloc.restart_count} times)" if alloc.restart_count else "")
    )
    requeue_for: list[str] = []
    steps = NodeSteps(others, steps_argv, os.environ, logs)
    try:
        # scancel's SIGTERM (to every process of the job) is followed by SIGKILL after
        # KillWait: the stop, and its record, fit in it.
        target = Slurm(
            hosts, job_id, steps, requeue_for.append, continue_record=alloc.restart_count > 0,
            stop_within=max(1.0, kill_wait() - KILL_WAIT_MARGIN),
        )  # fmt: skip
        code = launch(job, target)
        return _requeue(alloc, plan, requeue_for) if requeue_for and code == 1 else code
    finally:
        steps.end()


def _drainer(hosts: ControllerHost) -> Callable[[Event], None]:
    """A listener that drains the Slurm node of a node lost or found unhealthy."""
    warned: list[bool] = []

    def on_event(event: Event) -> None:
        if event.kind != EventKind.FAULT or event.node is None or hosts.service is None:
            return
        kind = event.data.get("type")
        if kind not in {t.value for t in DRAINED_FAULTS}:
            return
        record = next(
            (h for h in hosts.service.roster.hosts.values() if h.node_id == event.node), None
        )
        if record is None:
            return
        reason = f"trainguard: {kind} of {event.node}: {event.message}"[:200]
        why = drain(record.hostname, reason)
        if why is None:
            say(f"Slurm node {record.hostname} drained ({kind})")
        elif not warned:
            warned.append(True)
            say(f"warning: could not drain Slurm node {record.hostname}: {why}")

    return on_event


def _requeue(alloc: Allocation, plan: JobPlan, nodes: list[str]) -> int:
    budget = plan.job.spec.trainguard.max_requeues
    if alloc.restart_count >= budget:
        say(
            f"the allocation can no longer hold the job ({', '.join(nodes)} had no node left) "
            f"and it was requeued {alloc.restart_count} times already (maxRequeues {budget})"
        )
        return 1
    say(
        f"the allocation can no longer hold the job ({', '.join(nodes)} had no node left): "
        f"requeuing Slurm job {alloc.job_id} ({alloc.restart_count + 1} of {budget}); the "
        "next run resumes from the newest durable checkpoint"
    )
    why = requeue(alloc.job_id)
    if why is not None:
        say(f"requeue failed: {why}")
        return 1
    time.sleep(60)  # Slurm ends this script; should it not, the job ends as failed
    return 1


def in_step_endpoint(alloc: Allocation, port: int) -> JobEndpoint:
    """``srun trainguard run`` on every node: the allocation's first node is the endpoint."""
    return JobEndpoint(resolve(alloc.nodes[0]), port)
