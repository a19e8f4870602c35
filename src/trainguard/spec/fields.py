"""Shared building blocks of the spec models: base classes, field types, checks.

Spec-level objects (`SpecModel`) reject unknown fields; Kubernetes objects inside a pod
template (`KubeModel`) accept and keep them. Both use camelCase names in YAML/JSON and
snake_case attributes in Python.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from trainguard.monitor.regex import compile_regex
from trainguard.spec.limits import MAX_DURATION_SECONDS, MAX_NPROC_PER_NODE

FIELD_PROBLEM = "field_problem"
"""Error type of a model-level check that blames one named field (see `field_problem`)."""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_LABEL_HELP = (
    "must be a lowercase DNS-1123 name: a-z, 0-9 and '-', "
    "starting and ending with a letter or digit, at most 63 characters"
)
_NPROC = re.compile(r"^(auto|cpu|gpu|[1-9][0-9]*)$")

Seconds = Annotated[float, Field(gt=0, le=MAX_DURATION_SECONDS, allow_inf_nan=False)]
"""A duration: finite, > 0, at most a year (see `limits`)."""
NonNegativeSeconds = Annotated[float, Field(ge=0, le=MAX_DURATION_SECONDS, allow_inf_nan=False)]
"""A duration that may be 0: finite, at most a year."""


def field_problem(field: str, message: str) -> PydanticCustomError:
    """An error for a check on a whole model that blames one of its fields (camelCase)."""
    return PydanticCustomError(
        FIELD_PROBLEM, "{field}: {message}", {"field": field, "message": message}
    )


def _check_dns_label(value: str) -> str:
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ValueError(DNS_LABEL_HELP)
    return value


def _check_regex(value: str) -> str:
    """A user's pattern runs on every output line: RE2 (linear time) must compile it."""
    compile_regex(value)  # RegexError (a ValueError) gives RE2's reason
    return value


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _check_module_name(value: str) -> str:
    if len(value) > 200 or not _MODULE_NAME.match(value):
        raise ValueError("must be a dotted Python module name, e.g. transformers or my_pkg.model")
    return value


DnsName = Annotated[str, AfterValidator(_check_dns_label)]
ModuleName = Annotated[str, AfterValidator(_check_module_name)]
Regex = Annotated[str, AfterValidator(_check_regex)]


def normalize_nproc_per_node(value: object) -> object:
    """Accept "auto" | "cpu" | "gpu" | a positive integer (int or numeric string) -> str."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("must be auto, cpu, gpu or a positive integer")
    if isinstance(value, int):
        if value > MAX_NPROC_PER_NODE:  # before str(): a 5000-digit int cannot be one
            raise ValueError(f"must be <= {MAX_NPROC_PER_NODE}")
        value = str(value)
    if isinstance(value, str) and _NPROC.match(value.strip()):
        value = value.strip()
        if value.isdigit() and (len(value) > 9 or int(value) > MAX_NPROC_PER_NODE):
            raise ValueError(f"must be <= {MAX_NPROC_PER_NODE}")
        return value
    raise ValueError("must be auto, cpu, gpu or a positive integer")


NprocPerNode = Annotated[
    str,
    BeforeValidator(normalize_nproc_per_node),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 1, "maximum": MAX_NPROC_PER_NODE},
                {"type": "string", "pattern": _NPROC.pattern},
            ],
            "x-kubernetes-int-or-string": True,
        }
    ),
]


class SpecModel(BaseModel):
    """Spec-level object: camelCase names, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class KubeModel(BaseModel):
    """Kubernetes object inside a pod template: unknown fields accepted and preserved."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="allow",
        frozen=True,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
