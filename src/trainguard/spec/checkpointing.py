"""``spec.checkpointing``: the checkpoint tiers (a trainguard extension).

The training script's :class:`trainguard.checkpoint.Checkpointer` reads these
settings from its environment (``TRAINGUARD_CHECKPOINT_CONFIG``), so the same
script runs with other settings by changing only the spec.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from trainguard.spec.fields import Seconds, SpecModel
from trainguard.spec.limits import (
    MAX_CHECKPOINT_REPLICAS,
    MAX_DURABLE_KEEP,
    MAX_EVERY_STEPS,
    MAX_MEMORY_KEEP,
)

DEFAULT_MEMORY_KEEP = 2
DEFAULT_DURABLE_KEEP = 3
DEFAULT_DURABLE_EVERY_SECONDS = 300.0


class Checkpointing(SpecModel):
    """Tiered checkpoints: node memory, replicas in peers' memory, durable storage."""

    memory_every_steps: int = Field(
        default=1,
        ge=1,
        le=MAX_EVERY_STEPS,
        description="Checkpointer.save(step, ...) snapshots into node memory when step is a "
        "multiple of this.",
    )
    memory_keep: int = Field(
        default=DEFAULT_MEMORY_KEEP,
        ge=1,
        le=MAX_MEMORY_KEEP,
        description="Snapshots each rank keeps in memory.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=MAX_CHECKPOINT_REPLICAS,
        description="Other nodes that hold a copy of each node's memory snapshots, so a lost "
        "node's state is still in RAM (0: none; capped at nodes - 1).",
    )
    durable_url: str | None = Field(
        default=None,
        description="Where snapshots are persisted: a local path or an fsspec URL such as "
        "s3://bucket/prefix. Unset: <job directory>/durable on the local platform.",
    )
    durable_every_steps: int | None = Field(
        default=None,
        ge=1,
        le=MAX_EVERY_STEPS,
        description="Persist every N steps (and/or every N seconds).",
    )
    durable_every_seconds: Seconds | None = Field(
        default=DEFAULT_DURABLE_EVERY_SECONDS,
        description="Persist when this long has passed since the last durable write.",
    )
    durable_keep: int = Field(
        default=DEFAULT_DURABLE_KEEP,
        ge=1,
        le=MAX_DURABLE_KEEP,
        description="Durable checkpoints kept (newest).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options for durableUrl (e.g. endpoint_url for S3). "
        "Credentials belong in the environment or a profile (AWS_ACCESS_KEY_ID, AWS_PROFILE, "
        "...), which the agents inherit; keys like key/secret/token here are shown as ***.",
    )

    @model_validator(mode="after")
    def _durable_has_a_trigger(self) -> Checkpointing:
        if self.durable_every_steps is None and self.durable_every_seconds is None:
            raise ValueError("set durableEverySteps or durableEverySeconds (or both)")
        return self

    def env_json(self, default_durable_url: str) -> dict[str, Any]:
        """What the Checkpointer reads from ``TRAINGUARD_CHECKPOINT_CONFIG``."""
        data = self.model_dump(by_alias=True)
        data["durableUrl"] = self.durable_url or default_durable_url
        data["durableWriter"] = "agent"  # the controller picks the step, the agents write it
        return data
