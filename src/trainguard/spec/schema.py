"""The TrainingJob JSON Schema, shaped to be reusable in a Kubernetes CRD.

Differences from pydantic's default output, all on purpose: optional fields are simply
not required (no `anyOf [..., {type: null}]`, which a structural CRD schema rejects),
`default: null` is left out, and properties carry no generated titles. `$ref`s remain
(there are no cycles), so a CRD generator can inline them.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, NoDefault
from pydantic_core import core_schema

from trainguard.spec.model import TrainingJob


class _CrdFriendlySchema(GenerateJsonSchema):
    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        value = super().get_default_value(schema)
        return NoDefault if value is None else value

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def json_schema() -> dict[str, Any]:
    """The TrainingJob JSON Schema with camelCase names (what `trainguard schema` prints)."""
    return TrainingJob.model_json_schema(by_alias=True, schema_generator=_CrdFriendlySchema)
