"""Kubernetes objects embedded in a job: its metadata and the replicas' pod template.

They are kept permissive (unknown fields accepted and preserved, as a real pod template
has many) except `ObjectMeta`, which accepts only Kubernetes' own metadata fields.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from trainguard.spec.fields import DNS_LABEL_HELP, DnsName, KubeModel, field_problem
from trainguard.spec.limits import MAX_TEMPLATE_SIZE, JsonSize, describe_bytes

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


class KeySelector(KubeModel):
    """One key of a Secret or ConfigMap (Kubernetes SecretKeySelector, ConfigMapKeySelector)."""

    name: str = Field(description="The Secret (ConfigMap) in the job's namespace.")
    key: str = Field(min_length=1, description="The key whose value the variable takes.")
    optional: bool | None = Field(
        default=None, description="Whether the Secret (ConfigMap) or its key may be missing."
    )


class EnvVarSource(KubeModel):
    """Where a variable's value comes from (Kubernetes EnvVarSource): exactly one source."""

    secret_key_ref: KeySelector | None = Field(
        default=None,
        description="A key of a Kubernetes Secret: on a cluster Kubernetes puts its value in "
        "the pod's env; locally the key is looked up in --env-file files, then the caller's "
        "environment.",
    )
    config_map_key_ref: KeySelector | None = Field(
        default=None, description="A key of a ConfigMap (Kubernetes only)."
    )
    field_ref: dict[str, Any] | None = Field(
        default=None, description="A field of the pod (Kubernetes only)."
    )
    resource_field_ref: dict[str, Any] | None = Field(
        default=None, description="A resource of the container (Kubernetes only)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        given = [n for n, f in type(self).model_fields.items() if getattr(self, n) is not None]
        if len(given) != 1:
            names = "secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef"
            raise ValueError(f"needs exactly one of {names}")
        return self


class EnvVar(KubeModel):
    """An environment variable of the container (Kubernetes EnvVar)."""

    name: str = Field(description="Variable name.")
    value: str | None = Field(
        default=None, description="Value; $(VAR) references to earlier variables are expanded."
    )
    value_from: EnvVarSource | None = Field(
        default=None,
        description="Where the value comes from instead (Kubernetes valueFrom); locally only "
        "secretKeyRef.",
    )

    @model_validator(mode="after")
    def _value_or_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise field_problem("valueFrom", "cannot be given with value")
        return self


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

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        """A template is at most MAX_TEMPLATE_SIZE as JSON (its YAML aliases expanded)."""
        if JsonSize(data).size > MAX_TEMPLATE_SIZE:
            raise ValueError(f"larger than {describe_bytes(MAX_TEMPLATE_SIZE)} as JSON")
        return data
