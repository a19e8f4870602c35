"""The base of every wire model, and errors that name the field.

Every message between the controller, the agents and the workers is a pydantic model
derived from :class:`Wire`: frozen, unknown fields refused, strict types (``true`` is not
an integer, ``"1"`` is not a number). A body that does not fit raises :class:`WireError`,
whose message names the field as a path from the body's root, e.g.
``assignment.master_port: Input should be less than or equal to 65535, got 70000``.
"""

from __future__ import annotations

import json
from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["Wire", "WireError", "error_text", "parse_json"]

W = TypeVar("W", bound="Wire")


class Wire(BaseModel):
    """A message on the wire: frozen, strict, no unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def to_json(self) -> dict[str, Any]:
        """The body as a dict of JSON values: exactly what goes on the wire."""
        data: dict[str, Any] = json.loads(self.model_dump_json())
        return data

    @classmethod
    def from_json(cls, data: Any, root: str = "") -> Self:
        """Validate JSON-able ``data`` as it would arrive on the wire (strict JSON types);
        :class:`WireError` naming the field."""
        return parse_json(cls, json.dumps(data), root)


class WireError(ValueError):
    """A body that does not fit its model; the message names the field."""


def error_text(exc: ValidationError, root: str) -> str:
    """One line per problem, each naming its field from ``root`` (the first problem only
    when there are many: one clear line beats a page)."""
    error = exc.errors(include_url=False)[0]
    path = root
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "[key]":
            name = _field_name(str(part))
            path += f".{name}" if path else name
    kind = error["type"]
    if kind == "missing":
        return f"{path}: missing"
    if kind == "extra_forbidden":
        return f"{path}: unknown field"
    if kind in ("model_type", "dict_type"):
        return f"{path or 'body'}: expected a JSON object"
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind == "json_invalid":
        return f"{root or 'body'}: malformed JSON ({error.get('ctx', {}).get('error', message)})"
    shown = repr(error.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{path}: {message}, got {shown}"


def _field_name(name: str) -> str:
    """A field's name as an error shows it: a name from a hostile body (any length, any
    character) stays short and on one line."""
    if name.isprintable() and len(name) <= 64:
        return name
    shown = repr(name)
    return shown if len(shown) <= 64 else shown[:61] + "..."


def parse_json(model: type[W], raw: str | bytes, root: str) -> W:
    """``model`` from a JSON body; :class:`WireError` naming the field (from ``root``)."""
    if not raw.strip():
        raise WireError(f"{root or 'body'}: expected a JSON object, got nothing")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise WireError(error_text(exc, root)) from None
