"""``spec.elasticPolicy``: HyperPod's elastic scaling bounds, sizes and timeouts (acted
on by :mod:`trainguard.control.elastic`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from trainguard.spec.fields import NonNegativeSeconds, SpecModel, field_problem
from trainguard.spec.limits import MAX_DISCRETE_VALUES, MAX_NODES

__all__ = ["ElasticPolicy"]


class ElasticPolicy(SpecModel):
    """Elastic scaling: the job runs between minReplicas and maxReplicas nodes, scaling
    down when nodes are taken away and up when capacity comes back (a restart at the new
    WORLD_SIZE; locally, the capacity is `trainguard scale` / `--inject`)."""

    min_replicas: int | None = Field(default=None, ge=1, le=MAX_NODES, description="Fewest nodes.")
    max_replicas: int | None = Field(default=None, ge=1, le=MAX_NODES, description="Most nodes.")
    replica_increment_step: int | None = Field(
        default=None, ge=1, le=MAX_NODES, description="Scale in steps of this many nodes."
    )
    replica_discrete_values: list[Annotated[int, Field(ge=1, le=MAX_NODES)]] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_DISCRETE_VALUES,
        description="Allowed node counts.",
    )
    scaling_timeout_in_seconds: NonNegativeSeconds | None = Field(
        default=None, description="Wait for new nodes this long before scaling."
    )
    graceful_shutdown_timeout_in_seconds: NonNegativeSeconds | None = Field(
        default=None, description="Graceful stop time before a scaling event."
    )
    faulty_scale_down_timeout_in_seconds: NonNegativeSeconds | None = Field(
        default=None, description="Wait this long for a replacement before scaling down."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ElasticPolicy:
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and hi is not None and lo > hi:
            raise field_problem("minReplicas", f"must be <= maxReplicas ({hi})")
        if self.replica_increment_step is not None and self.replica_discrete_values is not None:
            raise field_problem(
                "replicaDiscreteValues", "mutually exclusive with replicaIncrementStep"
            )
        for value in self.replica_discrete_values or []:
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise field_problem(
                    "replicaDiscreteValues", f"{value} is outside minReplicas..maxReplicas"
                )
        return self
