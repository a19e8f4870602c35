"""The job spec: the `TrainingJob` model, loading and validation, and the resolved plan.

job = load_job("job.yaml")            # or parse_job(data, source), cli_job(...)
plan = resolve_plan(job, "job.yaml")  # what the controller and platforms run
"""

from trainguard.spec.cli_job import cli_job, dns_name
from trainguard.spec.elastic import ElasticPolicy
from trainguard.spec.kube import Container, EnvVar, ObjectMeta, PodSpec, PodTemplateSpec
from trainguard.spec.launcher import LauncherError, LauncherLine, parse_launcher
from trainguard.spec.load import (
    HYPERPOD_API_VERSION,
    HYPERPOD_KIND,
    SpecError,
    load_job,
    parse_job,
)
from trainguard.spec.model import (
    API_VERSION,
    KIND,
    LogRule,
    ReplicaSpec,
    RestartPolicy,
    RunPolicy,
    TrainguardOptions,
    TrainingJob,
    TrainingJobSpec,
)
from trainguard.spec.plan import JobPlan, NodeGroupPlan, resolve_nproc_per_node, resolve_plan
from trainguard.spec.schema import json_schema

__all__ = [
    "API_VERSION",
    "HYPERPOD_API_VERSION",
    "HYPERPOD_KIND",
    "KIND",
    "Container",
    "ElasticPolicy",
    "EnvVar",
    "JobPlan",
    "LauncherError",
    "LauncherLine",
    "LogRule",
    "NodeGroupPlan",
    "ObjectMeta",
    "PodSpec",
    "PodTemplateSpec",
    "ReplicaSpec",
    "RestartPolicy",
    "RunPolicy",
    "SpecError",
    "TrainguardOptions",
    "TrainingJob",
    "TrainingJobSpec",
    "cli_job",
    "dns_name",
    "json_schema",
    "load_job",
    "parse_job",
    "parse_launcher",
    "resolve_nproc_per_node",
    "resolve_plan",
]
