"""A job's plan as its pods run it: the local plan, leaving Kubernetes its own share."""

from __future__ import annotations

import copy
import re
from typing import Any

from trainguard.kube.security import privileged_requests
from trainguard.spec import JobPlan, SpecError, TrainingJob, parse_job, resolve_plan
from trainguard.spec.secrets import looks_secret

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def kube_plan(job: TrainingJob, source: str, *, allow_privileged: bool = False) -> JobPlan:
    """The job's plan as a pod runs it; raises SpecError naming the field.

    The container's ``env`` (values, ``valueFrom``, ``envFrom``) is Kubernetes' to
    resolve: the plan leaves every ``$(VAR)`` in the worker argv for Kubernetes to expand
    in the pod, so no env value is ever written into the pod's command, and its ``env``
    is empty. As locally, a secret (``valueFrom.secretKeyRef``, or a name that looks
    secret) may not be a ``$(VAR)`` of the command: Kubernetes would expand it into the
    workers' command line. A symbolic ``nprocPerNode`` (auto, gpu) is the container's
    ``nvidia.com/gpu`` limit. Unless ``allow_privileged``, templates asking for
    node-level privileges are refused (:mod:`trainguard.kube.security`).
    """
    data = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    spec = data["spec"]
    problems = [] if allow_privileged else privileged_requests(spec)
    if problems := problems + _secrets_in_argv(spec):
        raise SpecError(source, problems)
    nproc = spec.get("nprocPerNode")
    for group in spec["replicaSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        gpus = ((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
        if nproc in ("auto", "gpu") and gpus is not None:
            spec["nprocPerNode"] = str(gpus)
    if not str(spec.get("nprocPerNode", "1")).isdigit():
        raise SpecError(
            source,
            [
                (
                    "spec.nprocPerNode",
                    f"{nproc!r} needs a number of workers per pod on Kubernetes "
                    "(or an nvidia.com/gpu limit on the first container)",
                )
            ],
        )
    try:
        return resolve_plan(parse_job(_unexpanded(data), source), source)
    except SpecError as unexpanded:
        # A $(VAR) in a launcher flag (--nproc-per-node=$(N)) is only known in the pod.
        try:
            resolve_plan(parse_job(_expanded(data), source), source)
        except SpecError:
            raise unexpanded from None
        hint = " (on Kubernetes, $(VAR) is expanded in the pod: write launcher flags out)"
        problems = [(path, message + hint) for path, message in unexpanded.problems]
        raise SpecError(source, problems) from None


def _secrets_in_argv(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field path, problem)`` for each ``$(VAR)`` of a secret in a command or args."""
    problems: list[tuple[str, str]] = []
    for index, group in enumerate(spec["replicaSpecs"]):
        here = f"spec.replicaSpecs[{index}].template.spec.containers[0]"
        container = group["template"]["spec"]["containers"][0]
        hidden: set[str] = set()
        for var in container.get("env") or []:
            refs = _VAR_REF.findall(var.get("value") or "")
            secret = "secretKeyRef" in (var.get("valueFrom") or {})
            if secret or looks_secret(var["name"]) or any(r in hidden for r in refs):
                hidden.add(var["name"])  # a secret, or made of one
        for part in ("command", "args"):
            for position, arg in enumerate(container.get(part) or []):
                for name in _VAR_REF.findall(arg):
                    if name in hidden:
                        problems.append(
                            (
                                f"{here}.{part}[{position}]",
                                f"$({name}) would put a secret on the workers' command line "
                                f"(ps on the node shows it); read ${name} from the environment",
                            )
                        )
    return problems


def _unexpanded(data: dict[str, Any]) -> dict[str, Any]:
    """The job with no env, and every ``$$`` doubled in command/args: the plan's own
    expansion then leaves ``$(VAR)`` as is and turns ``$$`` back into ``$$``, Kubernetes'
    escape of a literal ``$`` in a container's command."""
    data = copy.deepcopy(data)
    for group in data["spec"]["replicaSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        container.pop("env", None)
        container.pop("envFrom", None)
        for key in ("command", "args"):
            if key in container:
                container[key] = [arg.replace("$$", "$$$$") for arg in container[key]]
    return data


def _expanded(data: dict[str, Any]) -> dict[str, Any]:
    """The job with its literal env values (what the local plan would expand)."""
    data = copy.deepcopy(data)
    for group in data["spec"]["replicaSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container.get("env") or [] if "valueFrom" not in e]
        container.pop("envFrom", None)
    return data
