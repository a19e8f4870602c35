"""Shared building blocks of the spec models: base classes, field types, checks.

Spec-level objects (`SpecModel`) reject unknown fields; Kubernetes objects inside a pod
template (`KubeModel`) accept and keep them. Both use camelCase names in YAML/JSON and
snake_case attributes in Python.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Sequence
from typing import Annotated, Any, Union, get_args, get_origin

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


# -- "did you mean" ----------------------------------------------------------------------


def did_you_mean(root: type[BaseModel], loc: Sequence[int | str]) -> str | None:
    """For an unknown field at ``loc`` (a pydantic error's location, the field last): the
    known field of that object its name is closest to (``nprocPerNod`` -> ``nprocPerNode``),
    or None when none is close or the object is not a spec model."""
    if not loc or not isinstance(loc[-1], str):
        return None
    types_here: list[Any] = [root]
    for part in loc[:-1]:
        types_here = [t for tp in types_here for t in _inside(tp, part)]
    names = sorted({name for tp in types_here for m in _members(tp) for name in _field_names(m)})
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    if not close:  # a case slip: nprocpernode
        close = [n for n in names if n.lower() == loc[-1].lower()][:1]
    return close[0] if close else None


def _field_names(tp: Any) -> list[str]:
    """A spec model's field names as YAML spells them (camelCase)."""
    if not (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return []
    return [field.alias or name for name, field in tp.model_fields.items()]


def _inside(tp: Any, part: int | str) -> list[Any]:
    """The types that ``tp``'s value holds at key or index ``part``."""
    out: list[Any] = []
    for member in _members(tp):
        if isinstance(member, type) and issubclass(member, BaseModel) and isinstance(part, str):
            out += [
                field.annotation
                for name, field in member.model_fields.items()
                if part in (name, field.alias)
            ]
        elif get_origin(member) in (list, tuple, Sequence) and isinstance(part, int):
            out += [a for a in get_args(member) if a is not Ellipsis][:1]
        elif get_origin(member) is dict and isinstance(part, str):
            out += list(get_args(member)[1:2])
    return out


def _members(tp: Any) -> list[Any]:
    """``tp`` without ``Annotated``, ``Optional`` and unions: the types it may be."""
    if get_origin(tp) is Annotated:
        return _members(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        return [m for arg in get_args(tp) for m in _members(arg)]
    return [tp]
