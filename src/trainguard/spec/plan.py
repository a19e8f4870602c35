"""Turn a validated `TrainingJob` into the concrete `JobPlan` the controller runs.

Rules (the local platform ignores the image; trainguard's own interpreter runs workers):
- the worker argv is the first container's `command + args`, with Kubernetes `$(VAR)`
  references expanded from the container's env;
- a launcher line (torchrun, hyperpodrun, python -m torch.distributed.run) is stripped:
  `[sys.executable, "-u", script, *args]`, `-m` -> `[sys.executable, "-u", "-m", module,
  ...]`, `--no-python` -> `[script, *args]`; its --nproc-per-node / --nnodes /
  --max-restarts fill spec fields left unset, and must agree with fields that are set;
- a bare `python`/`python3` becomes `sys.executable`, with `-u` added;
- `nprocPerNode` resolves to a number: an integer, `cpu` -> os.cpu_count(), `gpu` ->
  CUDA devices (error if none), `auto` -> CUDA devices if any, else cpu; unset -> 1.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from trainguard.spec.launcher import LauncherError, LauncherLine, parse_launcher
from trainguard.spec.load import SpecError
from trainguard.spec.model import Container, ReplicaSpec, TrainingJob

DEFAULT_NPROC_PER_NODE = "1"  # torchrun's default; HyperPod's "auto" would mean 1 per core
_BARE_PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_T = TypeVar("_T", str, int)
_COMMAND = ".template.spec.containers[0].command"


@dataclass(frozen=True)
class NodeGroupPlan:
    """One replica group: `replicas` identical nodes, each running the same workers."""

    name: str
    replicas: int  # nodes in this group
    spares: int
    command: tuple[str, ...]  # the worker argv, launcher stripped, ready to exec
    env: dict[str, str]
    working_dir: str | None
    ignored_flags: tuple[str, ...] = ()  # launcher flags dropped (trainguard decides those)


@dataclass(frozen=True)
class JobPlan:
    """Everything the controller and a platform need to run the job.

    Counts here are resolved (launcher flags applied); read them from the plan, not from
    `job.spec`, which is kept as written.
    """

    name: str
    nproc_per_node: int
    groups: tuple[NodeGroupPlan, ...]
    max_restarts: int  # runPolicy.jobMaxRetryCount
    active_deadline_seconds: float | None
    stop_grace_seconds: float
    poll_interval_seconds: float
    node_start_timeout_seconds: float
    job: TrainingJob  # the validated spec, for everything else (restartPolicy, log rules, ...)

    @property
    def nnodes(self) -> int:
        """Total nodes across groups (spares not included)."""
        return sum(group.replicas for group in self.groups)

    @property
    def world_size(self) -> int:
        """Total workers (ranks)."""
        return self.nnodes * self.nproc_per_node


def resolve_plan(job: TrainingJob, source: str) -> JobPlan:
    """Resolve `job` into a `JobPlan`; raises SpecError (naming `source`) when it cannot."""
    spec = job.spec
    groups: list[NodeGroupPlan] = []
    launchers: list[tuple[str, LauncherLine]] = []
    for index, replica_spec in enumerate(spec.replica_specs):
        group, launcher = _group_plan(replica_spec, f"spec.replicaSpecs[{index}]", source)
        groups.append(group)
        if launcher is not None:
            launchers.append((f"spec.replicaSpecs[{index}]{_COMMAND}", launcher))

    nproc = _agreed(
        source,
        "spec.nprocPerNode",
        spec.nproc_per_node,
        [(where, "--nproc-per-node", line.nproc_per_node) for where, line in launchers],
    )
    max_restarts = _agreed(
        source,
        "spec.runPolicy.jobMaxRetryCount",
        spec.run_policy.job_max_retry_count,
        [(where, "--max-restarts", line.max_restarts) for where, line in launchers],
    )
    groups = _apply_nnodes(source, spec.replica_specs, groups, launchers)
    options = spec.trainguard
    return JobPlan(
        name=job.metadata.name,
        nproc_per_node=resolve_nproc_per_node(nproc or DEFAULT_NPROC_PER_NODE, source),
        groups=tuple(groups),
        max_restarts=max_restarts or 0,
        active_deadline_seconds=spec.run_policy.active_deadline_seconds,
        stop_grace_seconds=options.stop_grace_period_seconds,
        poll_interval_seconds=options.poll_interval_seconds,
        node_start_timeout_seconds=options.node_start_timeout_seconds,
        job=job,
    )


def resolve_nproc_per_node(value: str, source: str) -> int:
    """Resolve auto | cpu | gpu | a numeric string to a number of workers per node."""
    if value.isdigit():
        return int(value)
    cpus = os.cpu_count() or 1
    if value == "cpu":
        return cpus
    gpus = _cuda_device_count()
    if value == "gpu" and gpus == 0:
        raise SpecError(source, [("spec.nprocPerNode", "gpu requested but no CUDA device found")])
    return gpus or cpus


def _cuda_device_count() -> int:
    import torch  # deferred: only "gpu"/"auto" need it, and it takes seconds to import

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _group_plan(
    replica_spec: ReplicaSpec, where: str, source: str
) -> tuple[NodeGroupPlan, LauncherLine | None]:
    container = replica_spec.template.spec.containers[0]
    here = f"{where}.template.spec.containers[0]"
    env = _container_env(container, here, source)
    argv = [_expand(arg, env) for arg in [*container.command, *container.args]]
    if not argv:
        raise SpecError(
            source,
            [(f"{here}.command", "empty; the local platform ignores the image, so set command")],
        )
    try:
        launcher = parse_launcher(argv)
    except LauncherError as err:
        raise SpecError(source, [(f"{here}.command", str(err))]) from None
    command = _worker_argv(launcher) if launcher is not None else _plain_argv(argv)
    group = NodeGroupPlan(
        name=replica_spec.name,
        replicas=replica_spec.replicas,
        spares=replica_spec.spares,
        command=tuple(command),
        env=env,
        working_dir=container.working_dir,
        ignored_flags=launcher.ignored if launcher is not None else (),
    )
    return group, launcher


def _container_env(container: Container, here: str, source: str) -> dict[str, str]:
    problems: list[tuple[str, str]] = []
    if (container.model_extra or {}).get("envFrom"):
        problems.append((f"{here}.envFrom", "not supported by the local platform"))
    env: dict[str, str] = {}
    for index, var in enumerate(container.env):
        if var.value_from is not None:
            problems.append(
                (f"{here}.env[{index}].valueFrom", "not supported by the local platform")
            )
            continue
        env[var.name] = _expand(var.value or "", env)
    if problems:
        raise SpecError(source, problems)
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, `$$` is a literal `$`."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _VAR_REF.sub(replace, text)


def _worker_argv(line: LauncherLine) -> list[str]:
    if line.module:
        return [sys.executable, "-u", "-m", line.script, *line.script_args]
    if line.no_python:
        return [line.script, *line.script_args]
    return [sys.executable, "-u", line.script, *line.script_args]


def _plain_argv(argv: list[str]) -> list[str]:
    if not _BARE_PYTHON.match(argv[0]):
        return argv
    rest = argv[1:]
    leading = []
    for arg in rest:
        if not arg.startswith("-") or arg in ("-m", "-c", "-"):
            break
        leading.append(arg)
    return [sys.executable, *rest] if "-u" in leading else [sys.executable, "-u", *rest]


def _agreed(
    source: str,
    field: str,
    spec_value: _T | None,
    launcher_values: Sequence[tuple[str, str, _T | None]],
) -> _T | None:
    """The spec's value, else the launchers' (which must agree with it and each other)."""
    value, origin = spec_value, field
    for where, flag, launcher_value in launcher_values:
        if launcher_value is None:
            continue
        if value is None:
            value, origin = launcher_value, f"{flag}={launcher_value} in {where}"
        elif str(value) != str(launcher_value):
            raise SpecError(
                source,
                [(field, f"{value} disagrees with {flag}={launcher_value} in {where}")]
                if origin == field
                else [(where, f"{flag}={launcher_value} disagrees with {origin}")],
            )
    return value


def _apply_nnodes(
    source: str,
    replica_specs: Sequence[ReplicaSpec],
    groups: list[NodeGroupPlan],
    launchers: Sequence[tuple[str, LauncherLine]],
) -> list[NodeGroupPlan]:
    """Check launcher --nnodes against the node count; fill a single group's replicas."""
    for where, line in launchers:
        if line.nnodes is None:
            continue
        total = sum(group.replicas for group in groups)
        if line.nnodes == total:
            continue
        flag = f"--nnodes={line.nnodes} in {where}"
        if len(groups) == 1 and "replicas" not in replica_specs[0].model_fields_set:
            groups = [replace(groups[0], replicas=line.nnodes)]
        elif len(groups) == 1:
            problem = f"{total} disagrees with {flag}"
            raise SpecError(source, [("spec.replicaSpecs[0].replicas", problem)])
        else:
            problem = f"the groups' replicas add up to {total}, which disagrees with {flag}"
            raise SpecError(source, [("spec.replicaSpecs", problem)])
    return groups
