"""The ``trainguard`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from trainguard.argtypes import int_in, non_negative_int
from trainguard.health.command import add_health_check_parser, health_check_command
from trainguard.kube.flags import (
    add_cluster_flags,
    add_install_flags,
    add_submit_flags,
    run_on_cluster,
    wants_cluster,
)
from trainguard.observe.terminal import silence
from trainguard.platform import views
from trainguard.platform.inject import INJECT_HELP
from trainguard.platform.store import JobNotFound, StateDirError, open_store
from trainguard.spec.cli_job import DEFAULT_MAX_RESTARTS
from trainguard.spec.hyperpod_flags import add_hyperpodrun_flags

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a reader gone early
_positive_int = int_in(1)
_port = int_in(0, 65535)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        help="where jobs, events and logs are kept "
        "(default: $TRAINGUARD_STATE_DIR or ~/.trainguard)",
    )
    parser = argparse.ArgumentParser(
        prog="trainguard",
        description="Fault-tolerant distributed PyTorch training.",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def job_verb(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A verb that acts on one job (its first argument)."""
        verb = sub.add_parser(name, parents=[common], **kwargs)
        verb.add_argument("job", help="job id or name")
        return verb

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a job on this machine (from a spec, or torchrun-style)",
        description=(
            "Run a job on this machine: `trainguard run -f job.yaml`, or torchrun-style "
            "`trainguard run --nnodes 2 --nproc-per-node 2 train.py [args...]`."
        ),
    )
    run.add_argument(
        "-f",
        "--file",
        help="a TrainingJob (or HyperPodPyTorchJob, or Kubeflow PyTorchJob) YAML file",
    )
    run.add_argument(
        "--nnodes",
        type=_nnodes,
        metavar="N|MIN:MAX",
        help="nodes: agents on this machine, or hosts with --rdzv-endpoint; MIN:MAX is an "
        "elastic range (it starts at MIN and grows as capacity, or hosts, come)",
    )
    run.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        help="workers per node: an integer, auto, cpu or gpu",
    )
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=non_negative_int,
        help=f"restarts before the job fails (default {DEFAULT_MAX_RESTARTS}; torchrun's is 0)",
    )
    run.add_argument("--name", help="job name (default: the script's name)")
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="treat the script as a Python module, like python -m",
    )
    run.add_argument(
        "--no-python", action="store_true", help="run the script directly instead of through Python"
    )
    run.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's one-machine rendezvous: accepted; every job without --rdzv-endpoint "
        "or --master-addr runs on this machine",
    )
    run.add_argument("--inject", action="append", default=[], metavar="SPEC", help=INJECT_HELP)
    run.add_argument(
        "--env-file",
        action="append",
        default=[],
        metavar="FILE",
        help="KEY=VALUE lines where the spec's env valueFrom.secretKeyRef keys are looked up "
        "before this command's environment (repeatable; a later file wins); read now, "
        "never stored",
    )
    run.add_argument(
        "--cold-start",
        action="store_true",
        help="start every worker as a fresh interpreter, not forked from a warm template "
        "(the same as spec.trainguard.warmStart: false)",
    )
    run.add_argument(
        "--no-live",
        action="store_true",
        help="no live progress line at the bottom of the terminal (there is none when "
        "stdout is not a terminal, or TERM=dumb)",
    )
    run.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve the job's Prometheus metrics on http://HOST:PORT/metrics (0: any free port)",
    )
    run.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address --metrics-port binds (default 127.0.0.1: this machine only)",
    )
    run.add_argument(
        "--metrics-linger",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="keep serving metrics this long after the job ends, for a last scrape",
    )
    add_hyperpodrun_flags(run)
    hosts = run.add_argument_group(
        "several hosts",
        "run the same command on every host; the host that owns --rdzv-endpoint runs the "
        "controller and node 0, the others join it (docs: Several machines)",
    )
    hosts.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        metavar="HOST[:PORT]",
        help="where the job's controller listens (port 29500 if none is given)",
    )
    hosts.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=non_negative_int,
        help="this host's node rank (default: the order hosts join in)",
    )
    hosts.add_argument(
        "--join-timeout",
        type=_seconds,
        default=600.0,
        metavar="SECONDS",
        help="how long the hosts have to join (default 600, torchrun's)",
    )
    hosts.add_argument(
        "--token-file",
        metavar="FILE",
        help="the job's token, the same file on every host (else $TRAINGUARD_TOKEN)",
    )
    hosts.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate")
    hosts.add_argument("--tls-key", metavar="FILE", help="the certificate's private key")
    hosts.add_argument(
        "--tls-ca", metavar="FILE", help="check the other hosts' certificates against this CA"
    )
    hosts.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        metavar="HOST",
        help="torchrun's static rendezvous: the same as --rdzv-endpoint HOST:--master-port",
    )
    hosts.add_argument(
        "--master-port", "--master_port", dest="master_port", type=_port, default=29500
    )
    hosts.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        help="accepted and ignored: the controller assigns ranks",
    )
    hosts.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        dest="rdzv_id",
        help="accepted and ignored (the job id is the controller's)",
    )
    run.add_argument("script", nargs="?", help="training script (torchrun-style form)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")

    lst = sub.add_parser("list", parents=[common], help="list jobs")
    lst.add_argument("-o", "--output", choices=["text", "json"], default="text")
    lst.add_argument(
        "-A", "--all-namespaces", action="store_true", help="with --kube: every namespace"
    )
    add_cluster_flags(lst)

    desc = job_verb("describe", help="show a job: nodes, ranks, events")
    desc.add_argument("-o", "--output", choices=["text", "json"], default="text")
    add_cluster_flags(desc)

    report = job_verb(
        "report",
        help="write a job's report: one HTML page and a PNG of its main figure",
        description="Write a self-contained HTML report of a job (running or ended) and, "
        "beside it, a PNG of its main figure (the step over time, faults, recovery).",
    )
    report.add_argument(
        "-o", "--output", metavar="FILE.html", help="the page (default: ./<job>-report.html)"
    )

    logs = job_verb("logs", help="print a job's worker output")
    logs.add_argument("--rank", type=non_negative_int, help="only this global rank")
    logs.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    add_cluster_flags(logs)

    resume = job_verb(
        "resume",
        help="go on with a job whose controller died (re-attach, or restart from a checkpoint)",
        description=(
            "Take a Lost job (its `trainguard run` was killed or crashed) over: re-attach to its "
            "node agents if they still train (spec.trainguard.controllerGraceSeconds), else "
            "restart it from its newest checkpoint. The job keeps its id."
        ),
    )
    resume.add_argument(
        "-f", "--file", help="the job's spec (needed to restart a job whose spec has secrets)"
    )
    resume.add_argument(
        "--env-file",
        action="append",
        default=[],
        metavar="FILE",
        help="KEY=VALUE lines for the spec's env valueFrom.secretKeyRef keys (as for run)",
    )

    nodes = job_verb("nodes", help="a local job's nodes and their health status")
    nodes.add_argument("-o", "--output", choices=["text", "json"], default="text")
    node = sub.add_parser("node", parents=[common], help="act on a node of a running local job")
    node_verbs = node.add_subparsers(dest="node_verb", required=True, metavar="ACTION")
    replace = node_verbs.add_parser(
        "replace",
        help="take the node out of the job (UnschedulablePendingReplacement): the job "
        "restarts on a spare",
    )
    replace.add_argument("job", help="job id or name")
    replace.add_argument("node", help="node id, e.g. node-1 (see `trainguard nodes JOB`)")
    replace.add_argument("--reason", default="replacement asked for", help="why (recorded)")

    scale = job_verb(
        "scale",
        help="set how many nodes a running elastic job may use (it scales to fit)",
    )
    scale.add_argument(
        "--capacity", type=non_negative_int, required=True, metavar="N", help="nodes available"
    )

    stop = job_verb(
        "stop",
        help="stop a running job and keep its record (its phase becomes Stopped)",
        description="Stop a running local job: every rank is stopped, the job's record, logs "
        "and checkpoints are kept (describe, logs and report go on working). A job whose "
        "controller died (Lost) has what is left of it killed.",
    )
    delete = job_verb(
        "delete", help="stop a job and remove its record and logs (its checkpoints are kept)"
    )
    for command in (stop, delete):
        command.add_argument(
            "--timeout",
            type=float,
            default=60.0,
            help="seconds to wait for a running job to stop (default 60)",
        )
    delete.add_argument(
        "--checkpoints",
        action="store_true",
        help="also remove the job's durable checkpoints (kept by default: "
        "<job dir>/durable and <job dir>/checkpoints, or <durableUrl>/<job id> on local disk)",
    )
    delete.add_argument(
        "--force",
        action="store_true",
        help="also when its controller does not stop in time (it is killed) or its record "
        "is odd: kill what is left of it and remove it (only processes whose start time "
        "matches the recorded one are ever signalled)",
    )
    add_cluster_flags(delete)

    submit = sub.add_parser(
        "submit",
        parents=[common],
        help="submit a job to the Kubernetes cluster, or with --slurm to Slurm",
        usage="%(prog)s -f FILE [--slurm [SBATCH OPTION ...] | cluster flags]",
    )
    submit.add_argument(
        "-f",
        "--file",
        required=True,
        help="a TrainingJob (or HyperPod, or Kubeflow PyTorchJob: submitted as a TrainingJob) YAML",
    )
    submit.add_argument(
        "--slurm",
        action="store_true",
        help="write the job's batch script and sbatch it; options trainguard does not "
        "know are sbatch's (docs/slurm.md)",
    )
    add_cluster_flags(submit, kube_flag=False)
    add_submit_flags(submit)
    manifests = sub.add_parser(
        "manifests", help="print the CRD, RBAC and operator Deployment as YAML"
    )
    add_install_flags(manifests)
    for verb, text in (("install", "apply"), ("uninstall", "delete")):
        cluster = sub.add_parser(verb, help=f"{text} the CRD, RBAC and operator on the cluster")
        add_install_flags(cluster)
        add_cluster_flags(cluster, kube_flag=False)
        if verb == "install":
            cluster.add_argument(
                "--wait",
                type=_seconds,
                default=60.0,
                metavar="SECONDS",
                help="then watch the operator's pods this long: exit 1 when its image cannot "
                "be pulled (default 60; 0: do not wait)",
            )

    sub.add_parser("schema", parents=[common], help="print the TrainingJob JSON Schema")
    add_health_check_parser(sub)
    return parser


def _nnodes(text: str) -> tuple[int, int]:
    """``N`` or torchrun's elastic ``MIN:MAX``."""
    low, sep, high = text.partition(":")
    first = _positive_int(low)
    last = _positive_int(high) if sep else first
    if last < first:
        raise argparse.ArgumentTypeError(f"MIN:MAX with MIN <= MAX, got {text}")
    return first, last


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is a traceback again
        return code
    except BrokenPipeError:
        # Whoever read our output stopped (`trainguard list | head`): no traceback, and
        # nothing more to flush into the closed pipe at exit.
        silence(sys.stdout)
        return EXIT_BROKEN_PIPE


def parse_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but ``submit --slurm`` keeps the options trainguard
    does not know as sbatch's (``args.sbatch_args``)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown and not (args.verb == "submit" and args.slurm):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.sbatch_args = unknown
    return args


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parse_command_line(parser, argv)
    if args.verb == "submit" and args.slurm:
        from trainguard.slurm.submit import submit_slurm

        return submit_slurm(args, args.sbatch_args)
    if args.verb == "schema":
        from trainguard.spec import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    if args.verb == "health-check":
        return health_check_command(args)
    if wants_cluster(args):
        return run_on_cluster(args)
    if args.verb == "run":
        from trainguard.platform.run import run_command

        return run_command(args, parser)
    if args.verb == "resume":
        from trainguard.platform.resume_command import resume_command

        return resume_command(args)
    try:
        store = open_store(args.state_dir, writable=False)
    except StateDirError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.verb == "list":
            return views.list_jobs(store, args.output)
        if args.verb == "describe":
            return views.describe(store, args.job, args.output)
        if args.verb == "report":
            from trainguard.observe.report import report_command

            return report_command(store, args.job, args.output)
        if args.verb == "logs":
            return views.logs(store, args.job, args.rank, args.follow)
        if args.verb == "stop":
            from trainguard.platform.stop import stop

            return stop(store, args.job, args.timeout)
        if args.verb == "delete":
            from trainguard.platform.stop import delete

            return delete(store, args.job, args.timeout, args.force, args.checkpoints)
        if args.verb == "nodes":
            from trainguard.platform import nodes_view

            return nodes_view.nodes(store, args.job, args.output)
        if args.verb == "node":
            from trainguard.platform import nodes_view

            return nodes_view.replace(store, args.job, args.node, args.reason)
        if args.verb == "scale":
            from trainguard.platform import nodes_view

            return nodes_view.scale(store, args.job, args.capacity)
    except JobNotFound as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        store.close()
    parser.error(f"unknown verb {args.verb}")
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
