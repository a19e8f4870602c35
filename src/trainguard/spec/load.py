"""Read a job spec from YAML (or parsed data) into a validated `TrainingJob`.

Accepted documents:
- `apiVersion: trainguard.dev/v1`, `kind: TrainingJob`;
- `apiVersion: sagemaker.amazonaws.com/v1`, `kind: HyperPodPyTorchJob` (any case, docs also
  spell it HyperPodPytorchJob). The field names are the same, so it is relabelled and
  validated by the same rules: unknown fields are errors here too;
- `apiVersion: kubeflow.org/v1`, `kind: PyTorchJob`: converted into a TrainingJob
  (`trainguard.spec.pytorchjob`); the fields it ignores are warned about on stderr, and
  errors name the PyTorchJob's fields.
A top-level `status` (as in `kubectl get -o yaml` output) is ignored for every kind.

Every problem becomes a `SpecError` naming the file and the field, one line per problem.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from trainguard.spec.fields import FIELD_PROBLEM, did_you_mean
from trainguard.spec.limits import (
    MAX_NESTING,
    MAX_SPEC_FILE_BYTES,
    MAX_SPEC_SIZE,
    JsonSize,
    describe_bytes,
)
from trainguard.spec.model import API_VERSION, KIND, TrainingJob
from trainguard.spec.pytorchjob import (
    KUBEFLOW_API_VERSION,
    KUBEFLOW_KIND,
    Conversion,
    PyTorchJobError,
    convert,
    is_pytorchjob,
)

HYPERPOD_API_VERSION = "sagemaker.amazonaws.com/v1"
HYPERPOD_KIND = "HyperPodPyTorchJob"
_IGNORED_TOP_LEVEL = ("status",)


class SpecError(Exception):
    """A job spec that cannot be used; `str()` gives one `source: path: message` per line."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        super().__init__(source, list(problems))
        self.source = source
        self.problems: list[tuple[str, str]] = list(problems)

    def __str__(self) -> str:
        return "\n".join(
            f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}"
            for path, message in self.problems
        )


def load_job(path: str | Path) -> TrainingJob:
    """Read and validate a job spec file (TrainingJob, HyperPodPyTorchJob or PyTorchJob YAML)."""
    source = str(path)
    try:
        with Path(path).open("rb") as file:  # not read_text: /dev/zero or 20 GB never ends
            raw = file.read(MAX_SPEC_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SpecError(source, [("", "file not found")]) from None
    except IsADirectoryError:
        raise SpecError(source, [("", "is a directory, not a job spec file")]) from None
    except UnicodeDecodeError:
        raise SpecError(source, [("", "not UTF-8 text")]) from None
    except OSError as err:
        raise SpecError(source, [("", f"cannot read: {err.strerror or err}")]) from None
    if len(raw) > MAX_SPEC_FILE_BYTES:
        limit = describe_bytes(MAX_SPEC_FILE_BYTES)
        raise SpecError(source, [("", f"larger than {limit}, the most a job spec may be")])
    return parse_job(_parse_yaml(text, source), source)


def parse_job(data: object, source: str) -> TrainingJob:
    """Validate parsed YAML/JSON data; `source` names it in errors (a path, "command line")."""
    if data is None:
        raise SpecError(source, [("", "empty document; expected a TrainingJob mapping")])
    if not isinstance(data, Mapping):
        raise SpecError(
            source,
            [("", f"expected a mapping (apiVersion, kind, metadata, spec), got {_kind_of(data)}")],
        )
    body = {key: value for key, value in data.items() if key not in _IGNORED_TOP_LEVEL}
    _check_size(body, source)
    _check_api_and_kind(body, source)
    conversion: Conversion | None = None
    if is_pytorchjob(body):
        conversion = converted(body, source)
        for path, why in conversion.ignored:
            print(f"trainguard: warning: {source}: {path}: ignored: {why}", file=sys.stderr)
        body = conversion.body
    body["apiVersion"], body["kind"] = API_VERSION, KIND
    try:
        return TrainingJob.model_validate(body)
    except ValidationError as err:
        problems = problems_of(err)
        if conversion is not None:
            problems = [(conversion.origin(path), message) for path, message in problems]
        raise SpecError(source, problems) from None


def converted(body: Mapping[Any, Any], source: str) -> Conversion:
    """A Kubeflow PyTorchJob as a TrainingJob mapping (not validated yet); SpecError names
    the PyTorchJob's fields it refuses."""
    try:
        return convert(body)
    except PyTorchJobError as err:
        raise SpecError(source, err.problems) from None


def _check_size(body: Mapping[Hashable, Any], source: str) -> None:
    """Refuse a document too large or too deep to store, before anything expands it.

    YAML aliases are loaded as shared objects (cheap), but storing the spec as JSON
    expands each of them: a billion-laughs template of a few hundred bytes would become
    gigabytes. `JsonSize` counts every alias expanded, measuring each object once.
    """
    measured = JsonSize(body)
    if measured.depth > MAX_NESTING:
        raise SpecError(source, [("", f"nested more than {MAX_NESTING} levels deep")])
    if measured.size > MAX_SPEC_SIZE:
        limit = describe_bytes(MAX_SPEC_SIZE)
        where = format_path(measured.path_over(body, MAX_SPEC_SIZE))
        problem = f"larger than {limit} as JSON, with its YAML aliases expanded (an alias bomb?)"
        raise SpecError(source, [(where, problem)])


def _check_api_and_kind(body: Mapping[Hashable, Any], source: str) -> None:
    api, kind = body.get("apiVersion"), body.get("kind")
    problems: list[tuple[str, str]] = []
    if api is None:
        problems.append(("apiVersion", "field required"))
    elif api not in (API_VERSION, HYPERPOD_API_VERSION, KUBEFLOW_API_VERSION):
        others = f"{HYPERPOD_API_VERSION}, or {KUBEFLOW_API_VERSION} for a {KUBEFLOW_KIND}"
        problems.append(("apiVersion", f"must be {API_VERSION} (or {others})"))
    if kind is None:
        problems.append(("kind", "field required"))
    elif api == API_VERSION and kind != KIND:
        problems.append(("kind", f"must be {KIND} for apiVersion {API_VERSION}"))
    elif api == HYPERPOD_API_VERSION and str(kind).lower() != HYPERPOD_KIND.lower():
        problems.append(("kind", f"must be {HYPERPOD_KIND} for apiVersion {api}"))
    elif api == KUBEFLOW_API_VERSION and kind != KUBEFLOW_KIND:
        problems.append(("kind", f"must be {KUBEFLOW_KIND} for apiVersion {api}"))
    if problems:
        raise SpecError(source, problems)


# --- YAML -----------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _parse_yaml(text: str, source: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = err.problem or err.context or "syntax error"
        raise SpecError(source, [("", f"invalid YAML{where}: {what}")]) from None
    except yaml.YAMLError as err:
        raise SpecError(source, [("", f"invalid YAML: {err}")]) from None
    except RecursionError:  # PyYAML composes and constructs nested nodes recursively
        raise SpecError(source, [("", f"nested more than {MAX_NESTING} levels deep")]) from None
    except Exception as err:  # a tag's constructor failing on its value: int("9" * 5000),
        # !!timestamp x (AttributeError), !!float x (ValueError), ...
        raise SpecError(source, [("", f"invalid YAML: a value cannot be read ({err})")]) from None


# --- pydantic errors -> (path, message) -------------------------------------------------


def problems_of(err: ValidationError) -> list[tuple[str, str]]:
    """Translate pydantic's errors into (dotted/indexed field path, short message); an
    unknown field of the TrainingJob gets the nearest known one ("did you mean")."""
    problems: list[tuple[str, str]] = []
    for detail in err.errors(include_url=False):
        loc = list(detail["loc"])
        message = _message(detail)
        ctx = detail.get("ctx") or {}
        if detail["type"] == FIELD_PROBLEM:
            loc.append(str(ctx["field"]))
        if message == _SIMPLE["extra_forbidden"] and (near := did_you_mean(TrainingJob, loc)):
            message += f"; did you mean {near}?"
        problems.append((format_path(loc), message))
    return problems


def format_path(loc: Sequence[int | str]) -> str:
    """("spec", "replicaSpecs", 0, "replicas") -> "spec.replicaSpecs[0].replicas"."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


_SIMPLE = {
    "missing": "field required",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "string_type": "must be a string (quote it in YAML)",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "finite_number": "must be a finite number",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "frozen_instance": "cannot be changed",
}
_BOUNDS = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def _message(detail: ErrorDetails) -> str:
    kind = detail["type"]
    ctx = detail.get("ctx") or {}
    if kind in _SIMPLE:
        return _SIMPLE[kind]
    if kind in _BOUNDS:
        symbol, key = _BOUNDS[kind]
        bound = ctx[key]
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"must be {symbol} {bound}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item(s)"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} item(s)"
    if kind == "string_too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else detail["msg"]
    if kind == "literal_error":
        return "must be one of: " + str(ctx["expected"]).replace("'", "").replace(" or ", ", ")
    if kind == "value_error":
        return str(ctx.get("error", detail["msg"]))
    if kind == FIELD_PROBLEM:
        return str(ctx["message"])
    msg = detail["msg"]
    return msg[:1].lower() + msg[1:]


def _kind_of(data: object) -> str:
    if isinstance(data, list):
        return "a list"
    if isinstance(data, str):
        return "a string"
    return f"a {type(data).__name__}"
