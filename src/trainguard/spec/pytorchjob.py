"""Kubeflow's ``PyTorchJob`` (``kubeflow.org/v1``) read as a `TrainingJob`: pure, no I/O.

Master (one replica) and Worker (n) are the job's ``1 + n`` nodes: one replica group when
their pod templates are alike, else two, the Master's first (it is node 0) and the
Worker's after it; their ``restartPolicy`` must agree (the retry budget is the job's). The
``pytorch`` container runs the workers. The retry budget (``jobMaxRetryCount``) is
HyperPod's auto-resume count (``sagemaker.amazonaws.com/enable-job-auto-resume: "true"``
and ``job-max-retry-count``, default 1), else ``runPolicy.backoffLimit``, else
``elasticPolicy.maxRestarts``; 0 with ``restartPolicy: Never``. Each pod template,
``nodeSelector`` included, is kept as written (Kubernetes' scheduler honours it; locally
only the container's command, args, env and workingDir are used). Fields trainguard has
no use for are ignored with a warning the caller prints; any other field, or a value of
the wrong kind, is refused naming it.
docs/kubernetes.md ("Kubeflow PyTorchJob") has the table of every field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from trainguard.spec.limits import MAX_RESTARTS

__all__ = ["Conversion", "PyTorchJobError", "as_written", "convert", "is_pytorchjob"]

KUBEFLOW_API_VERSION: Final = "kubeflow.org/v1"
KUBEFLOW_KIND: Final = "PyTorchJob"
AUTO_RESUME_ANNOTATION: Final = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY_ANNOTATION: Final = "sagemaker.amazonaws.com/job-max-retry-count"
DEFAULT_AUTO_RESUME_RETRIES: Final = 1  # `hyperpod start-job --auto-resume` without --max-retry
CONVERTED_FROM_ANNOTATION: Final = "trainguard.dev/converted-from"
CONVERTED_FROM: Final = f"{KUBEFLOW_API_VERSION} {KUBEFLOW_KIND}"
CONTAINER: Final = "pytorch"  # Kubeflow runs the container of this name
GPU_RESOURCE: Final = "nvidia.com/gpu"

_TOP: Final = frozenset({"apiVersion", "kind", "metadata", "spec"})
_SPEC: Final = frozenset({"pytorchReplicaSpecs", "runPolicy", "elasticPolicy", "nprocPerNode"})
_REPLICA: Final = frozenset({"replicas", "template", "restartPolicy"})
_RESTART_POLICIES: Final = ("Always", "OnFailure", "Never", "ExitCode")
_CLEAN_POD: Final = {"None": "None", "All": "All", "Running": "All"}
# Fields read as they are, and those ignored (with why), per object.
_RUN_POLICY_KEPT: Final = ("activeDeadlineSeconds", "ttlSecondsAfterFinished", "suspend")
_RUN_POLICY_IGNORED: Final = {
    "schedulingPolicy": "gang scheduling is the scheduler's (Volcano, scheduler-plugins); "
    "trainguard creates all of a job's pods at once",
    "managedBy": "trainguard runs the job it was given",
}
_RDZV: Final = "trainguard runs its own rendezvous for every attempt"
_RDZV_FIELDS: Final = ("rdzvBackend", "rdzvHost", "rdzvPort", "rdzvId", "rdzvConf", "standalone")
_ELASTIC_IGNORED: Final = {
    **dict.fromkeys(_RDZV_FIELDS, _RDZV),
    "metrics": "a HorizontalPodAutoscaler's metrics: trainguard scales on capacity "
    "(elasticPolicy's bounds), not on load",
}
_ELASTIC_USED: Final = frozenset({"minReplicas", "maxReplicas", "nProcPerNode", "maxRestarts"})


class PyTorchJobError(ValueError):
    """A PyTorchJob that cannot be run: ``problems`` is ``(field path, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__(problems)
        self.problems = problems


@dataclass(frozen=True)
class Conversion:
    """A PyTorchJob as a TrainingJob mapping (to validate), what was ignored, and where
    each TrainingJob field came from (to name the PyTorchJob's field in errors)."""

    body: dict[str, Any]
    ignored: tuple[tuple[str, str], ...] = ()  # (field path, why)
    origins: dict[str, str] = field(default_factory=dict)  # TrainingJob path -> PyTorchJob's

    def origin(self, path: str) -> str:
        """The PyTorchJob field a TrainingJob field path (``spec.replicaSpecs[0]...``) came
        from; the path itself where the names are the same."""
        for prefix in sorted(self.origins, key=len, reverse=True):
            if path == prefix or path.startswith((prefix + ".", prefix + "[")):
                return self.origins[prefix] + path[len(prefix) :]
        return path


def as_written(
    annotations: Mapping[str, str], groups: Sequence[str], problems: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Problems found in a converted job (its plan: a script, a launcher line) naming the
    PyTorchJob's fields: ``spec.replicaSpecs[i]`` is its Worker or its Master, by the
    group's name (``groups``, in order). A job not converted keeps its paths."""
    if annotations.get(CONVERTED_FROM_ANNOTATION) != CONVERTED_FROM:
        return problems
    renamed = Conversion({}, origins=_origins(groups))
    return [(renamed.origin(path), message) for path, message in problems]


def _origins(groups: Sequence[str]) -> dict[str, str]:
    """Each converted group's path, ``spec.replicaSpecs[i]``, to its PyTorchJob replica's."""
    return {f"spec.replicaSpecs[{i}]": _replica_path(name) for i, name in enumerate(groups)}


def _replica_path(group: str) -> str:
    kind = "Worker" if group == "worker" else "Master"
    return f"spec.pytorchReplicaSpecs.{kind}"


def is_pytorchjob(data: Mapping[Any, Any]) -> bool:
    return data.get("apiVersion") == KUBEFLOW_API_VERSION and data.get("kind") == KUBEFLOW_KIND


def convert(data: Mapping[Any, Any]) -> Conversion:
    """The TrainingJob of a PyTorchJob document (its ``status`` already dropped); raises
    PyTorchJobError naming every field it cannot take."""
    reader = _Reader()
    reader.unknown(data, "", _TOP)
    spec = reader.mapping(data.get("spec"), "spec", required=True)
    reader.unknown(spec, "spec", _SPEC)
    metadata = data.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    groups, group_origins, restart_policy = _groups(reader, spec)
    run_policy, budget_from = _run_policy(reader, spec, annotations, restart_policy)
    elastic = reader.mapping(spec.get("elasticPolicy"), "spec.elasticPolicy")
    reader.unknown(elastic, "spec.elasticPolicy", _ELASTIC_USED | set(_ELASTIC_IGNORED))
    for key, why in _ELASTIC_IGNORED.items():
        if key in elastic:
            reader.ignore(f"spec.elasticPolicy.{key}", why)
    bounds = {k: elastic[k] for k in ("minReplicas", "maxReplicas") if k in elastic}
    nproc, nproc_from = _nproc(reader, spec, elastic, groups)
    if reader.problems:
        raise PyTorchJobError(reader.problems)
    new_spec: dict[str, Any] = {"replicaSpecs": groups, "runPolicy": run_policy}
    if nproc is not None:
        new_spec["nprocPerNode"] = nproc
    if bounds:
        new_spec["elasticPolicy"] = bounds
    origins = {**group_origins, "spec.replicaSpecs": "spec.pytorchReplicaSpecs"}
    if budget_from:
        origins["spec.runPolicy.jobMaxRetryCount"] = budget_from
    if nproc_from:
        origins["spec.nprocPerNode"] = nproc_from
    body = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": _metadata(metadata),
        "spec": new_spec,
    }
    return Conversion(body, tuple(reader.ignored), origins)


class _Reader:
    """Collects problems (refused) and ignored fields while a document is read."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []
        self.ignored: list[tuple[str, str]] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append((path, message))

    def ignore(self, path: str, why: str) -> None:
        self.ignored.append((path, why))

    def mapping(self, value: object, path: str, *, required: bool = False) -> Mapping[Any, Any]:
        if value is None:
            if required:
                self.fail(path, "field required")
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, "must be a mapping")
            return {}
        return value

    def unknown(
        self, value: Mapping[Any, Any], path: str, known: frozenset[str] | set[str]
    ) -> None:
        for key in value:
            if key not in known:
                where = f"{path}.{key}" if path else str(key)
                self.fail(where, f"unknown field (a PyTorchJob's are: {', '.join(sorted(known))})")

    def count(self, value: object, path: str, *, least: int = 0) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, "must be an integer")
            return None
        if value < least:
            self.fail(path, f"must be >= {least}")
            return None
        if value > MAX_RESTARTS:
            self.fail(path, f"must be <= {MAX_RESTARTS}")
            return None
        return value


def _metadata(metadata: object) -> object:
    """The job's metadata (validated later as a TrainingJob's), marked as converted."""
    if not isinstance(metadata, Mapping):
        return metadata  # the TrainingJob's own check names it
    annotations = metadata.get("annotations")
    if annotations is not None and not isinstance(annotations, Mapping):
        return dict(metadata)
    return {
        **metadata,
        "annotations": {**(annotations or {}), CONVERTED_FROM_ANNOTATION: CONVERTED_FROM},
    }


def _groups(
    reader: _Reader, spec: Mapping[Any, Any]
) -> tuple[list[dict[str, Any]], dict[str, str], str]:
    """The replica groups of Master and Worker (one from their one template; else the
    Master's, node 0, then the Worker's), each group's PyTorchJob path by its TrainingJob
    path, and their restartPolicy."""
    path = "spec.pytorchReplicaSpecs"
    replicas = reader.mapping(spec.get("pytorchReplicaSpecs"), path, required=True)
    reader.unknown(replicas, path, frozenset({"Master", "Worker"}))
    if replicas and not ({"Master", "Worker"} & set(replicas)):
        return [], {}, "OnFailure"
    if not replicas and not reader.problems:
        reader.fail(path, "needs Master or Worker")
    read: dict[str, tuple[int, Any, str]] = {}
    for kind in ("Master", "Worker"):
        if kind not in replicas:
            continue
        here = f"{path}.{kind}"
        if not isinstance(replicas[kind], Mapping):
            reader.fail(here, "must be a mapping (replicas, restartPolicy, template)")
            continue
        replica = replicas[kind]
        reader.unknown(replica, here, _REPLICA)
        count = reader.count(replica.get("replicas", 1), f"{here}.replicas")
        if kind == "Master" and count not in (None, 1):
            reader.fail(f"{here}.replicas", "must be 1 (a PyTorchJob has one Master)")
        policy = replica.get("restartPolicy", "OnFailure")
        if policy not in _RESTART_POLICIES:
            reader.fail(f"{here}.restartPolicy", f"must be one of: {', '.join(_RESTART_POLICIES)}")
        template = reader.mapping(replica.get("template"), f"{here}.template", required=True)
        read[kind] = (count or 0, _pytorch_first(reader, template, f"{here}.template"), policy)
    if reader.problems:
        return [], {}, "OnFailure"
    if "Master" in read and "Worker" in read and read["Master"][2] != read["Worker"][2]:
        reader.fail(f"{path}.Worker.restartPolicy", f"must be the Master's ({read['Master'][2]})")
    if sum(nodes for nodes, _, _ in read.values()) < 1:
        reader.fail(path, "no replicas: Master and Worker add up to 0 nodes")
    policy = next(iter(read.values()))[2]
    master, worker = read.get("Master"), read.get("Worker")
    if master and worker and master[1] == worker[1]:
        read = {"Worker": (master[0] + worker[0], worker[1], policy)}  # one template
    groups = [
        {"name": kind.lower(), "replicas": nodes, "template": template}
        for kind, (nodes, template, _) in read.items()  # the Master's first: node 0
        if nodes
    ]
    return groups, _origins([str(group["name"]) for group in groups]), policy


def _pytorch_first(reader: _Reader, template: Mapping[Any, Any], here: str) -> Any:
    """The template with its ``pytorch`` container first (trainguard runs the first)."""
    pod = template.get("spec")
    if not isinstance(pod, Mapping) or not isinstance(pod.get("containers"), list):
        return dict(template)  # the TrainingJob's own checks name what is wrong
    containers = pod["containers"]
    named = [c for c in containers if isinstance(c, Mapping) and c.get("name") == CONTAINER]
    if not named:
        reader.fail(
            f"{here}.spec.containers",
            f"no container named {CONTAINER!r} (Kubeflow runs the container of that name)",
        )
        return dict(template)
    rest = [c for c in containers if c is not named[0]]
    return {**template, "spec": {**pod, "containers": [named[0], *rest]}}


def _run_policy(
    reader: _Reader,
    spec: Mapping[Any, Any],
    annotations: object,
    restart_policy: str,
) -> tuple[dict[str, Any], str]:
    """The TrainingJob's runPolicy, and the PyTorchJob field its retry budget came from."""
    here = "spec.runPolicy"
    given = reader.mapping(spec.get("runPolicy"), here)
    known = {"cleanPodPolicy", "backoffLimit", *_RUN_POLICY_KEPT, *_RUN_POLICY_IGNORED}
    reader.unknown(given, here, known)
    policy: dict[str, Any] = {k: given[k] for k in _RUN_POLICY_KEPT if k in given}
    for key, why in _RUN_POLICY_IGNORED.items():
        if key in given:
            reader.ignore(f"{here}.{key}", why)
    clean = given.get("cleanPodPolicy", "None")  # Kubeflow's default for a PyTorchJob
    if not isinstance(clean, str) or clean not in _CLEAN_POD:
        reader.fail(f"{here}.cleanPodPolicy", "must be one of: None, All, Running")
    else:
        policy["cleanPodPolicy"] = _CLEAN_POD[clean]
        if clean == "Running":
            reader.ignore(f"{here}.cleanPodPolicy", "Running: trainguard removes every pod (All)")
    candidates = _budgets(reader, spec, given, annotations)
    budget, origin = candidates[0] if candidates else (None, "")
    for _, other in candidates[1:]:
        reader.ignore(other, f"the retry budget is {origin}'s")
    if restart_policy == "Never":
        if budget:
            reader.ignore(origin, "restartPolicy Never: the job is not restarted")
        budget, origin = 0, "restartPolicy"
    elif restart_policy == "ExitCode" and budget:
        reader.ignore("restartPolicy", "ExitCode: every failure is retried, whatever its code")
    elif restart_policy == "Always":
        reader.ignore("restartPolicy", "Always: a job whose workers all exit 0 succeeds")
    if budget is not None:
        policy["jobMaxRetryCount"] = budget
    return policy, origin


def _budgets(
    reader: _Reader,
    spec: Mapping[Any, Any],
    run_policy: Mapping[Any, Any],
    annotations: object,
) -> list[tuple[int, str]]:
    """The retry budgets the job gives, most binding first: HyperPod's auto-resume,
    ``runPolicy.backoffLimit``, ``elasticPolicy.maxRestarts``."""
    found: list[tuple[int, str]] = []
    notes = annotations if isinstance(annotations, Mapping) else {}
    enabled_at = f'metadata.annotations["{AUTO_RESUME_ANNOTATION}"]'
    count_at = f'metadata.annotations["{MAX_RETRY_ANNOTATION}"]'
    enabled = notes.get(AUTO_RESUME_ANNOTATION)
    if enabled is not None and (not isinstance(enabled, str) or enabled.lower() not in _BOOLS):
        reader.fail(enabled_at, 'must be "true" or "false"')
    count = notes.get(MAX_RETRY_ANNOTATION)
    retries: int | None = None
    if count is not None:
        if isinstance(count, str) and count.isascii() and count.isdigit() and len(count) <= 9:
            retries = reader.count(int(count), count_at)
        else:
            reader.fail(count_at, 'must be a whole number in quotes, such as "2"')
    if isinstance(enabled, str) and enabled.lower() == "true":
        found.append((DEFAULT_AUTO_RESUME_RETRIES if retries is None else retries, count_at))
    elif count is not None:
        reader.ignore(count_at, f'auto-resume is off ({AUTO_RESUME_ANNOTATION} is not "true")')
    if "backoffLimit" in run_policy:
        limit = reader.count(run_policy["backoffLimit"], "spec.runPolicy.backoffLimit")
        if limit is not None:
            found.append((limit, "spec.runPolicy.backoffLimit"))
    elastic = spec.get("elasticPolicy")
    if isinstance(elastic, Mapping) and "maxRestarts" in elastic:
        most = reader.count(elastic["maxRestarts"], "spec.elasticPolicy.maxRestarts")
        if most is not None:
            found.append((most, "spec.elasticPolicy.maxRestarts"))
    return found


_BOOLS: Final = ("true", "false")


def _nproc(
    reader: _Reader,
    spec: Mapping[Any, Any],
    elastic: Mapping[Any, Any],
    groups: Sequence[Mapping[str, Any]],
) -> tuple[object, str]:
    """Workers per node and the field it came from (a number's kind is checked later)."""
    given = spec.get("nprocPerNode")
    legacy = elastic.get("nProcPerNode")
    if given is not None and legacy is not None and str(given) != str(legacy):
        reader.fail(
            "spec.elasticPolicy.nProcPerNode", f"disagrees with spec.nprocPerNode ({given})"
        )
    if given is not None:
        return _text(given), "spec.nprocPerNode"
    if legacy is not None:
        return _text(legacy), "spec.elasticPolicy.nProcPerNode"
    found: list[tuple[str, str]] = []  # (GPUs, where), of each group that gives them
    for group in groups:
        try:
            container = group["template"]["spec"]["containers"][0]
            gpus = container["resources"]["limits"][GPU_RESOURCE]
        except (KeyError, IndexError, TypeError):
            continue
        where = f"{_container_path(group)}.resources.limits[{GPU_RESOURCE}]"
        if isinstance(gpus, bool) or not isinstance(gpus, int | str):
            reader.fail(where, "must be a whole number")
            return None, ""
        found.append((str(gpus), where))
    if not found:
        return None, ""
    gpus, where = found[0]
    for other, at in found[1:]:
        if other != gpus:
            reader.fail(
                at,
                f"disagrees with {where} ({gpus}): every node runs as many workers "
                "(set spec.nprocPerNode)",
            )
    return gpus, where


def _container_path(group: Mapping[str, Any]) -> str:
    return f"{_replica_path(str(group.get('name')))}.template.spec.containers[{CONTAINER}]"


def _text(value: object) -> object:
    """An integer nprocPerNode as Kubeflow's string; anything else as given (the
    TrainingJob's check refuses it, naming the field)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value
