"""Kubernetes objects embedded in a job: its metadata and the replicas' pod template.

They are kept permissive (unknown fields accepted and preserved, as a real pod template
has many) except `ObjectMeta`, which accepts only Kubernetes' own metadata fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from trainguard.spec.fields import DNS_LABEL_HELP, DnsName, KubeModel, field_problem

# Kubernetes ObjectMeta fields besides name/namespace/labels/annotations; accepted (and
# kept) so that a manifest read back from a cluster still parses. Everything else is a typo.
_K8S_META_FIELDS = frozenset(
    {
        "generateName",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "finalizers",
        "ownerReferences",
        "managedFields",
        "selfLink",
    }
)


class ObjectMeta(BaseModel):
    """Kubernetes-style object metadata of the job."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", frozen=True
    )

    name: DnsName = Field(description="Job name, " + DNS_LABEL_HELP + ".")
    namespace: str = Field(default="default", description="Kubernetes namespace of the job.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels of the job.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of the job.")

    @model_validator(mode="after")
    def _only_kubernetes_fields(self) -> ObjectMeta:
        for key in self.model_extra or {}:
            if key not in _K8S_META_FIELDS:
                raise field_problem(key, "unknown field")
        return self


class EnvVar(KubeModel):
    """An environment variable of the container (Kubernetes EnvVar)."""

    name: str = Field(description="Variable name.")
    value: str | None = Field(
        default=None, description="Value; $(VAR) references to earlier variables are expanded."
    )
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="Kubernetes valueFrom source; not supported by the local platform.",
    )


class Container(KubeModel):
    """A container of the pod template. Only the first container runs the workers."""

    name: str = Field(description="Container name.")
    image: str | None = Field(
        default=None, description="Container image; ignored by the local platform."
    )
    command: list[str] = Field(
        default_factory=list,
        description="Entrypoint argv. May be a launcher line (torchrun, hyperpodrun, "
        "python -m torch.distributed.run); trainguard strips the launcher and runs the "
        "script directly on every worker.",
    )
    args: list[str] = Field(default_factory=list, description="Arguments appended to command.")
    env: list[EnvVar] = Field(default_factory=list, description="Environment of the workers.")
    working_dir: str | None = Field(default=None, description="Working directory of the workers.")
    resources: dict[str, Any] | None = Field(
        default=None, description="Kubernetes resource requests/limits; ignored locally."
    )


class PodSpec(KubeModel):
    """Kubernetes PodSpec; trainguard reads only `containers`, the rest is preserved."""

    containers: list[Container] = Field(
        min_length=1, description="Containers; the first one runs the training workers."
    )


class PodTemplateSpec(KubeModel):
    """Kubernetes PodTemplateSpec of one node (pod) of a replica group."""

    metadata: dict[str, Any] | None = Field(default=None, description="Pod metadata.")
    spec: PodSpec = Field(description="Pod spec.")
