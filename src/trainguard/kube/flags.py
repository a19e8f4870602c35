"""The cluster flags of the ``trainguard`` verbs, and the dispatch into :mod:`trainguard.kube.cli`.

Light on purpose: the CLI imports this on every run, and the ``kubernetes`` client
(the ``kube`` extra) is only imported once a cluster verb runs.
"""

from __future__ import annotations

import argparse
import sys

from trainguard.kube.config import DEFAULT_IMAGE, DEFAULT_NAMESPACE

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


def add_install_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--operator-namespace",
        default=DEFAULT_NAMESPACE,
        help=f"namespace of the operator (default {DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--image", default=DEFAULT_IMAGE, help=f"operator image (default {DEFAULT_IMAGE})"
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
