"""The cluster flags of the ``trainguard`` verbs, and the dispatch into :mod:`trainguard.kube.cli`.

Light on purpose: the CLI imports this on every run, and the ``kubernetes`` client
(the ``kube`` extra) is only imported once a cluster verb runs.
"""

from __future__ import annotations

import argparse
import re
import sys

from trainguard.kube.config import DEFAULT_IMAGE, DEFAULT_JOB_NAMESPACE, DEFAULT_NAMESPACE

EXIT_USAGE = 2
CLUSTER_VERBS = ("submit", "manifests", "install", "uninstall")


def add_cluster_flags(parser: argparse.ArgumentParser, kube_flag: bool = True) -> None:
    """``--kube`` (when the verb also works locally), ``--kubeconfig``, ``--context``, ``-n``."""
    if kube_flag:
        parser.add_argument(
            "--kube", action="store_true", help="act on the Kubernetes cluster, not this machine"
        )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube)")
    parser.add_argument("--context", help="kubeconfig context (default: the current one)")
    parser.add_argument("-n", "--namespace", help="namespace (default: the context's or default)")


_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _namespace(text: str) -> str:
    if not _NAMESPACE.match(text):
        raise argparse.ArgumentTypeError(
            f"{text[:80]!r} is not a namespace name (lowercase letters, digits and '-', at most 63)"
        )
    return text


def add_install_flags(parser: argparse.ArgumentParser) -> None:
    """Where the operator lives, where it runs jobs (its RBAC scope), and what it allows."""
    parser.add_argument(
        "--operator-namespace",
        default=DEFAULT_NAMESPACE,
        type=_namespace,
        help=f"namespace of the operator (default {DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"operator image (default {DEFAULT_IMAGE})"
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--job-namespace",
        action="append",
        type=_namespace,
        metavar="NS",
        dest="job_namespaces",
        help="a namespace the operator runs jobs in, with a Role there (repeatable; default "
        f"{DEFAULT_JOB_NAMESPACE})",
    )
    scope.add_argument(
        "--all-namespaces",
        action="store_true",
        help="run jobs in every namespace: a ClusterRole instead of namespaced Roles",
    )
    parser.add_argument(
        "--allow-privileged-pods",
        action="store_true",
        help="run pod templates that ask for privileged mode, host namespaces, hostPath "
        "volumes, privilege escalation or added capabilities (refused by default)",
    )
    parser.add_argument(
        "--no-network-policies",
        dest="network_policies",
        action="store_false",
        help="give jobs no NetworkPolicy (default: a job's pods take traffic only from each "
        "other, and the agent port only from the operator)",
    )
    health = parser.add_argument_group("node health")
    health.add_argument(
        "--hyperpod-labels",
        action="store_true",
        help="node health labels under HyperPod's sagemaker.amazonaws.com/ prefix (default "
        "trainguard.dev/): node-health-status, deep-health-check-status",
    )
    health.add_argument(
        "--no-node-labels",
        dest="node_labels",
        action="store_false",
        help="the operator neither labels nor taints unhealthy Nodes, nor reads their labels "
        "(no ClusterRole on nodes; pods still require a healthy label)",
    )
    health.add_argument(
        "--health-agent",
        action="store_true",
        help="a DaemonSet that runs the deep health checks on every Node, watches it, and "
        "labels and taints it",
    )
    health.add_argument(
        "--health-agent-kernel-log",
        action="store_true",
        help="the health agent also reads XID/NVRM lines from /dev/kmsg: it runs privileged, "
        "as root (implies --health-agent)",
    )


def add_submit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-privileged-pods",
        action="store_true",
        help="do not refuse a pod template that asks for node privileges here (the "
        "operator still does, unless it was installed with --allow-privileged-pods)",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    return args.verb in CLUSTER_VERBS or bool(getattr(args, "kube", False))


def run_on_cluster(args: argparse.Namespace) -> int:
    try:
        from trainguard.kube.cli import run
    except ModuleNotFoundError as exc:
        print(
            f"trainguard: {args.verb} needs the kube extra ({exc.name} is missing): "
            "pip install 'trainguard[kube]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return run(args)
