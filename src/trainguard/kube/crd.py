"""The ``trainingjobs.trainguard.dev`` CustomResourceDefinition, generated from the spec model.

The spec's JSON Schema (:func:`trainguard.spec.json_schema`) is turned into a
*structural* OpenAPI v3 schema as Kubernetes requires: ``$ref``s inlined, no
``additionalProperties: false`` (pruning drops unknown fields instead; the operator
still rejects them with the spec's own error), ``const`` as a one-value ``enum``,
numeric ``exclusiveMinimum`` as the OpenAPI v3.0 boolean form, int-or-string as the
one ``anyOf`` Kubernetes allows, and no defaults (the operator applies the spec's
defaults, so a stored object stays as the user wrote it).
"""

from __future__ import annotations

from typing import Any

from trainguard.kube.config import (
    CRD_NAME,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    Obj,
)
from trainguard.spec import json_schema

# Keys of a JSON Schema node that carry no meaning for Kubernetes and are dropped.
_DROPPED = frozenset({"title", "default", "$defs"})

STATUS_SCHEMA: Obj = {
    "type": "object",
    "description": "Observed state, written by the operator.",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "phase": {"type": "string", "description": "Pending, Running, Restarting, ..."},
        "reason": {"type": "string"},
        "restartCount": {"type": "integer", "description": "Restarts of any scope."},
        "startTime": {"type": "string", "format": "date-time"},
        "completionTime": {"type": "string", "format": "date-time"},
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string"},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                },
            },
        },
    },
}

PRINTER_COLUMNS: list[Obj] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural_spec_schema() -> Obj:
    """The TrainingJob ``spec`` as a structural OpenAPI v3 schema."""
    schema = json_schema()
    defs: Obj = schema.get("$defs", {})
    spec: Obj = _structural(schema["properties"]["spec"], defs)
    return spec


def crd() -> Obj:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    root = {
        "type": "object",
        "description": "A fault-tolerant distributed PyTorch training job.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": structural_spec_schema(),
            "status": STATUS_SCHEMA,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "trainguard"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def _structural(node: Any, defs: Obj) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if node.get("x-kubernetes-int-or-string"):
        either: Obj = {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
        }
        if "description" in node:
            either["description"] = node["description"]
        return either
    out: Obj = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _structural(value, defs)
            elif value is True and "properties" not in node:
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif key in ("properties",):
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        else:
            out[key] = _structural(value, defs)
    return out
