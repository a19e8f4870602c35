"""A job's plan as its pods run it: the local plan, leaving Kubernetes its own share."""

from __future__ import annotations

from trainguard.spec import JobPlan, SpecError, TrainingJob, parse_job, resolve_plan


def kube_plan(job: TrainingJob, source: str) -> JobPlan:
    """The job's plan as a pod runs it; raises SpecError naming the field.

    Kubernetes resolves ``valueFrom``/``envFrom`` itself, so they are left to it; a
    symbolic ``nprocPerNode`` (auto, gpu) is the container's ``nvidia.com/gpu`` limit.
    """
    data = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    spec = data["spec"]
    nproc = spec.get("nprocPerNode")
    for group in spec["replicaSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        container["env"] = [e for e in container.get("env") or [] if "valueFrom" not in e]
        container.pop("envFrom", None)
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
    return resolve_plan(parse_job(data, source), source)
