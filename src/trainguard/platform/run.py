"""``trainguard run``: turn flags or a spec file into a plan, then run it locally."""

from __future__ import annotations

import argparse
import os
import sys

from trainguard.hosts.addresses import JobEndpoint
from trainguard.hosts.run import endpoint_of
from trainguard.observe.live import live_wanted
from trainguard.platform.inject import parse_injection
from trainguard.platform.launch import JobToRun, launch, usage
from trainguard.platform.local import MetricsOptions
from trainguard.platform.resume_command import lost_twin, resume_job
from trainguard.platform.store import StateDirError, open_store
from trainguard.platform.target import LOCAL
from trainguard.rendezvous.client import rendezvous_mode
from trainguard.slurm.allocation import Allocation, SlurmError, in_allocation, spare_count
from trainguard.spec import SpecError, TrainingJob, cli_job, load_job, resolve_plan
from trainguard.spec.cli_job import DEFAULT_MAX_RESTARTS
from trainguard.spec.hyperpod_flags import flags_of_args, with_hyperpod_flags
from trainguard.spec.plan import check_local_size
from trainguard.spec.scripts import check_scripts
from trainguard.spec.secrets import SecretSource

_TORCHRUN_FLAGS = (
    "nnodes", "nproc_per_node", "max_restarts", "module", "no_python", "name",
    "pre_train_script", "pre_train_args", "post_train_script", "post_train_args",
    "shutdown_signal", "shutdown_timeout", "inprocess_restart", "inprocess_timeout",
)  # fmt: skip


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.file and args.script:
        parser.error(f"give either -f FILE or a script, not both (got script {args.script!r})")
    if not args.file and not args.script:
        parser.error("nothing to run: give -f job.yaml, or a script (trainguard run train.py)")
    if args.standalone and (args.rdzv_endpoint or args.master_addr):
        parser.error(
            "--standalone runs the job on this machine: not with --rdzv-endpoint or --master-addr"
        )
    try:
        if args.file:
            given = [
                f"--{f.replace('_', '-')}"
                for f in _TORCHRUN_FLAGS
                if getattr(args, f) not in (None, False)
            ]
            if given:
                parser.error(
                    f"{', '.join(given)} only apply to the torchrun-style form; "
                    f"set them in {args.file} instead"
                )
            source = args.file
            job = load_job(args.file)
        else:
            source = "command line"
            job = cli_job(
                args.script,
                args.script_args,
                nnodes=args.nnodes or (1, 1),
                nproc_per_node=args.nproc_per_node or "1",
                max_restarts=(
                    DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
                ),
                name=args.name,
                module=args.module,
                no_python=args.no_python,
            )
            job = with_hyperpod_flags(job, [(source, flags_of_args(args))], source)
        if args.cold_start:
            job = cold_started(job)
        slurm = in_allocation() and not args.standalone
        if slurm:
            job = with_allocation_spares(job)
        # Secrets are resolved now, into the plan (memory) only; see spec/secrets.py.
        plan = resolve_plan(job, source, SecretSource.load(args.env_file, os.environ))
        endpoint = endpoint_of(args, plan.nnodes)
        batch = slurm and endpoint is None and not Allocation.from_env().in_step
        if slurm and endpoint is None and not batch:  # srun trainguard run on every node
            endpoint = slurm_step_endpoint(args)
        if endpoint is None and not batch:
            check_local_size(plan, source)  # one machine: far fewer nodes than a cluster
        injections = [parse_injection(text) for text in args.inject]
        rendezvous_mode()  # TRAINGUARD_RENDEZVOUS_STORE: service or rank0
    except (ValueError, SlurmError, SpecError) as exc:  # a bad --inject SPEC, --env-file
        return usage(str(exc))
    try:
        store = open_store(args.state_dir)
    except StateDirError as exc:
        return usage(str(exc))
    try:
        check_scripts(plan, source)  # a missing script would fail every attempt
        lost = lost_twin(store, plan) if args.file and not injections and not batch else None
        if lost is not None:
            print(
                f"[trainguard] job {lost.id} ran this spec and is Lost (its controller died): "
                f"resuming it (`trainguard delete {lost.id}` first to start afresh)",
                file=sys.stderr,
            )
            return resume_job(store, lost, args.file, args.env_file)
        live = not args.no_live and live_wanted(sys.stdout)
        metrics = None
        if args.metrics_port is not None:
            metrics = MetricsOptions(args.metrics_port, args.metrics_host, args.metrics_linger)
        to_run = JobToRun(plan, store, source, injections, live, metrics)
        if batch:  # the batch script of a Slurm job: the controller, steps for the others
            from trainguard.slurm.run import run_in_allocation

            return run_in_allocation(args, to_run, sys.argv[1:], parser)
        if endpoint is not None:
            from trainguard.hosts.run import run_on_hosts

            return run_on_hosts(args, to_run, endpoint)
        return launch(to_run, LOCAL)
    except SpecError as exc:
        return usage(str(exc))
    finally:
        store.close()


def with_allocation_spares(job: TrainingJob) -> TrainingJob:
    """A job in a Slurm allocation: the allocation's nodes beyond the job's are spares (the
    last replica group's)."""
    groups = job.spec.replica_specs
    allocated = len(Allocation.from_env().nodes)
    nodes = sum(g.replicas for g in groups)
    spares = sum(g.spares for g in groups)
    extra = spare_count(nodes, spares, allocated) - spares
    if extra <= 0:
        return job
    last = groups[-1].model_copy(update={"spares": groups[-1].spares + extra})
    spec = job.spec.model_copy(update={"replica_specs": [*groups[:-1], last]})
    return job.model_copy(update={"spec": spec})


def slurm_step_endpoint(args: argparse.Namespace) -> JobEndpoint:
    """``srun trainguard run ...`` on every node: the allocation's first node is the
    endpoint (``--master-port``), each node's rank its ``SLURM_NODEID``."""
    from trainguard.slurm.run import in_step_endpoint

    alloc = Allocation.from_env()
    if args.node_rank is None:
        args.node_rank = alloc.step_node
    return in_step_endpoint(alloc, args.master_port)


def cold_started(job: TrainingJob) -> TrainingJob:
    """``job`` with warm worker starts turned off (``--cold-start``)."""
    options = job.spec.trainguard.model_copy(update={"warm_start": False})
    spec = job.spec.model_copy(update={"trainguard": options})
    return job.model_copy(update={"spec": spec})
