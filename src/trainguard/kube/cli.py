"""The ``trainguard`` verbs against a cluster: manifests, install, uninstall, submit, and
``list`` / ``describe`` / ``logs`` / ``delete`` with ``--kube``.

The cluster is the kubeconfig's (``--kubeconfig``, ``--context``; default ``$KUBECONFIG``
or ``~/.kube/config``); the namespace is ``-n`` or the job's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import yaml

from trainguard.kube.api import ConfigError, KubeApi, KubeError, NotFound
from trainguard.kube.config import (
    API_VERSION_FULL,
    DEFAULT_IMAGE,
    DEFAULT_JOB_NAMESPACE,
    KIND,
    Obj,
    OperatorConfig,
)
from trainguard.kube.health_manifests import HealthAgentOptions
from trainguard.kube.manifests import all_objects, to_yaml
from trainguard.kube.plan import kube_plan
from trainguard.kube.status import parse_time
from trainguard.platform.launch import usage
from trainguard.platform.views import TERMINAL_PHASES
from trainguard.spec import SpecError, load_job
from trainguard.spec.load import converted
from trainguard.spec.pytorchjob import is_pytorchjob
from trainguard.spec.secrets import redact_spec

EXIT_FAILED = 1
# How often `logs -f`, `delete` and `install --wait` look again.
FOLLOW_INTERVAL_SECONDS = 1.0
# A container waiting for these cannot start until its image is fixed (or pushed).
IMAGE_PROBLEMS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
DOCKERFILE = "deploy/Dockerfile"


def run(args: argparse.Namespace) -> int:
    """Dispatch one cluster verb; errors are one line on stderr and a non-zero exit."""
    if args.verb == "manifests":
        sys.stdout.write(to_yaml(_install_objects(args)))
        return 0
    try:
        job = _checked_job(args.file, args.allow_privileged_pods) if args.verb == "submit" else None
        api = KubeApi.connect(args.kubeconfig, args.context)
        namespace = args.namespace or _context_namespace(args.kubeconfig, args.context)
        verbs = {
            "install": lambda: _install(api, args),
            "uninstall": lambda: _uninstall(api, args),
            "submit": lambda: _submit(api, args, namespace, job),
            "list": lambda: _list(api, args, namespace),
            "describe": lambda: _describe(api, args, namespace),
            "logs": lambda: _logs(api, args, namespace),
            "delete": lambda: _delete(api, args, namespace),
        }
        return verbs[args.verb]()
    except (SpecError, ConfigError) as exc:
        return usage(str(exc))
    except NotFound as exc:
        return usage(f"not found: {exc}")
    except KubeError as exc:
        print(f"trainguard: cluster: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _context_namespace(kubeconfig: str | None, context: str | None) -> str:
    from kubernetes import config

    try:
        contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c["name"] == context), current) if context else current
    return str(((chosen or {}).get("context") or {}).get("namespace") or "default")


def _install_objects(args: argparse.Namespace) -> list[Obj]:
    """What ``manifests``, ``install`` and ``uninstall`` act on, from the install flags."""
    settings = OperatorConfig(
        allow_privileged_pods=args.allow_privileged_pods,
        network_policy=args.network_policies,
        hyperpod_labels=args.hyperpod_labels,
        node_labels=args.node_labels,
    )
    kernel_log = args.health_agent_kernel_log
    agent = HealthAgentOptions(kernel_log) if args.health_agent or kernel_log else None
    return all_objects(
        args.operator_namespace,
        args.image,
        settings,
        tuple(args.job_namespaces or (DEFAULT_JOB_NAMESPACE,)),
        args.all_namespaces,
        agent,
    )


def _install(api: KubeApi, args: argparse.Namespace) -> int:
    if args.image == DEFAULT_IMAGE:
        print(
            f"trainguard: the operator's image is {DEFAULT_IMAGE} (the default: what "
            f"{DOCKERFILE} builds, `docker build -f {DOCKERFILE} -t {DEFAULT_IMAGE} .`); the "
            f"cluster's nodes must have it (`kind load docker-image {DEFAULT_IMAGE}`), or push "
            f"it and pass --image REGISTRY/{DEFAULT_IMAGE}",
            file=sys.stderr,
        )
    objects = _install_objects(args)
    for obj in objects:
        print(f"{_ref(obj)} {api.apply(obj)}")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return _wait_for_operator(api, deployment, args.image, args.wait)


def _wait_for_operator(api: KubeApi, deployment: Obj, image: str, timeout: float) -> int:
    """Watch the operator's pods for up to ``timeout`` seconds: 0 once one runs, or when
    none does in time (a notice says so); 1 when its image cannot be pulled."""
    if timeout <= 0:
        return 0
    namespace = deployment["metadata"]["namespace"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    deadline = time.monotonic() + timeout
    while True:
        pods = api.list_pods(namespace, selector)
        for pod in pods:
            problem = image_problem(pod)
            if problem is not None:
                print(
                    f"trainguard: the operator cannot start: pod {pod['metadata']['name']}: "
                    f"{problem}. Build the image ({DOCKERFILE}) and put it where the cluster "
                    f"pulls from: `kind load docker-image {image}`, or push it to a registry "
                    "and install again with --image REGISTRY/NAME:TAG",
                    file=sys.stderr,
                )
                return EXIT_FAILED
        if any(_running(pod) for pod in pods):
            print(f"deployment/{deployment['metadata']['name']} running")
            return 0
        if time.monotonic() >= deadline:
            print(
                f"trainguard: the operator is not running after {timeout:g}s (pulling its "
                f"image?): kubectl -n {namespace} get pods",
                file=sys.stderr,
            )
            return 0
        time.sleep(FOLLOW_INTERVAL_SECONDS)


def image_problem(pod: Obj) -> str | None:
    """Why a pod's container cannot get its image (``ImagePullBackOff: ...``), if so."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PROBLEMS:
            image = status.get("image") or "its image"
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            return f"{waiting['reason']} for {image}{detail}"
    return None


def _running(pod: Obj) -> bool:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any("running" in (status.get("state") or {}) for status in statuses)


def _uninstall(api: KubeApi, args: argparse.Namespace) -> int:
    for obj in reversed(_install_objects(args)):
        print(f"{_ref(obj)} {api.remove(obj)}")
    return 0


def _ref(obj: Obj) -> str:
    where = obj["metadata"].get("namespace")
    return f"{str(obj['kind']).lower()}/{obj['metadata']['name']}" + (
        f" -n {where}" if where and obj["kind"] in ("Role", "RoleBinding") else ""
    )


def _checked_job(path: str, allow_privileged: bool = False) -> Obj:
    """The job file as a TrainingJob body (a Kubeflow PyTorchJob converted); SpecError
    (exit 2) names the file and field (a pod template asking for node privileges too,
    unless ``allow_privileged``)."""
    job = load_job(path)
    with open(path, encoding="utf-8") as f:
        body: Obj = yaml.safe_load(f)
    conversion = converted(body, path) if is_pytorchjob(body) else None
    try:
        kube_plan(job, path, allow_privileged=allow_privileged)
    except SpecError as exc:
        if conversion is None:
            raise
        problems = [(conversion.origin(where), problem) for where, problem in exc.problems]
        raise SpecError(path, problems) from None
    return conversion.body if conversion is not None else body


def _submit(api: KubeApi, args: argparse.Namespace, namespace: str, body: Obj | None) -> int:
    assert body is not None
    body.pop("status", None)
    body["apiVersion"], body["kind"] = API_VERSION_FULL, KIND
    meta = body["metadata"]
    meta["namespace"] = args.namespace or meta.get("namespace") or namespace
    api.create_job(meta["namespace"], body)
    print(f"trainingjob/{meta['name']} created in namespace {meta['namespace']}")
    return 0


def _list(api: KubeApi, args: argparse.Namespace, namespace: str) -> int:
    jobs = api.list_jobs(None if args.all_namespaces else namespace)
    rows = [_summary(job) for job in jobs]
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'NAMESPACE':<16} {'NAME':<28} {'PHASE':<11} {'RESTARTS':>8}  AGE")
    for row in rows:
        print(
            f"{row['namespace']:<16} {row['name']:<28} {row['phase']:<11} "
            f"{row['restarts']:>8}  {_age(row['created'])}"
        )
    return 0


def _summary(job: Obj) -> Obj:
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "phase": status.get("phase") or "Pending",
        "reason": status.get("reason") or "",
        "restarts": status.get("restartCount") or 0,
        "created": meta.get("creationTimestamp"),
    }


def _age(stamp: str | None) -> str:
    start = parse_time(stamp)
    if start is None:
        return "-"
    seconds = int(time.time() - start)
    if seconds < 120:
        return f"{seconds}s"
    return f"{seconds // 60}m" if seconds < 7200 else f"{seconds // 3600}h"


def _describe(api: KubeApi, args: argparse.Namespace, namespace: str) -> int:
    job = api.get_job(namespace, args.job)
    events = sorted(api.list_events(namespace, args.job), key=lambda e: e.get("lastTimestamp", ""))
    status = job.get("status") or {}
    if args.output == "json":
        data = {
            **_summary(job),
            "status": status,
            "spec": redact_spec(job.get("spec")),
            "events": [
                {k: e.get(k) for k in ("type", "reason", "message", "lastTimestamp")}
                for e in events
            ],
        }
        print(json.dumps(data, indent=2))
        return 0
    summary = _summary(job)
    print(f"Name:       {summary['name']}  (namespace {summary['namespace']})")
    print(f"Phase:      {summary['phase']}  {summary['reason']}")
    print(f"Restarts:   {summary['restarts']}  (attempt {status.get('attempt')})")
    faulty = status.get("latestFaultyPodInstanceList")
    if faulty:
        print(
            f"Last fault: {faulty.get('restartType')} pods {faulty.get('faultyPodList')} "
            f"ranks {faulty.get('faultyRankList')}"
        )
    print("Nodes:")
    for node in status.get("nodes") or []:
        print(
            f"  {node.get('nodeId'):<8} {node.get('pod'):<36} {node.get('state'):<10} "
            f"ip {node.get('podIP')} on {node.get('hostNode')} ranks {node.get('ranks')}"
        )
    print("Conditions:")
    for cond in status.get("conditions") or []:
        print(f"  {cond['type']:<12} {cond['status']:<6} {cond.get('lastTransitionTime', '')}")
    print("Events:")
    for event in events:
        print(
            f"  {event.get('lastTimestamp', ''):<21} {event.get('reason', ''):<18} "
            f"{event.get('message', '')}"
        )
    return 0


def _logs(api: KubeApi, args: argparse.Namespace, namespace: str) -> int:
    """Every rank's lines from the job's current pods (``[rankN]: ...``), or one rank's."""
    prefix = f"[rank{args.rank}]: " if args.rank is not None else "[rank"
    printed: dict[str, int] = {}
    while True:
        job = api.get_job(namespace, args.job)
        status = job.get("status") or {}
        for node in status.get("nodes") or []:
            pod = str(node.get("pod"))
            try:
                lines = api.pod_log(namespace, pod).splitlines()
            except NotFound:
                continue
            for line in lines[printed.get(pod, 0) :]:
                if line.startswith(prefix):
                    print(line)
            printed[pod] = len(lines)
        sys.stdout.flush()
        if not args.follow or status.get("phase") in TERMINAL_PHASES:
            return 0
        time.sleep(FOLLOW_INTERVAL_SECONDS)


def _delete(api: KubeApi, args: argparse.Namespace, namespace: str) -> int:
    """Delete the job; wait until the operator has stopped it and removed its pods."""
    api.delete_job(namespace, args.job)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            api.get_job(namespace, args.job)
        except NotFound:
            print(f"trainingjob/{args.job} deleted")
            return 0
        time.sleep(FOLLOW_INTERVAL_SECONDS)
    print(
        f"trainguard: trainingjob/{args.job} is still being deleted after {args.timeout:g}s "
        "(is the operator running?)",
        file=sys.stderr,
    )
    return EXIT_FAILED
