"""Turn a validated `TrainingJob` into the concrete `JobPlan` the controller runs.

Rules (the local platform ignores the image; trainguard's own interpreter runs workers):
- the worker argv is the first container's `command + args`, with Kubernetes `$(VAR)`
  references expanded from the container's env;
- a launcher line (torchrun, hyperpodrun, python -m torch.distributed.run) is stripped:
  `[sys.executable, "-u", script, *args]`, `-m` -> `[sys.executable, "-u", "-m", module,
  ...]`, `--no-python` -> `[script, *args]`; its --nproc-per-node / --nnodes /
  --max-restarts fill spec fields left unset, and must agree with fields that are set;
  hyperpodrun's own flags (pre/post-train scripts, shutdown signal and timeout, in-process
  restart) fill `spec.trainguard` the same way (see trainguard.spec.hyperpod_flags);
- `stopGracePeriodSeconds` is the stop's grace, 0 (SIGKILL at once) with
  `shutdownSignal: SIGKILL`;
- a bare `python`/`python3` becomes `sys.executable`, with `-u` added;
- `nprocPerNode` resolves to a number: an integer, `cpu` -> os.cpu_count(), `gpu` ->
  CUDA devices (error if none), `auto` -> CUDA devices if any, else cpu; unset -> 1;
- an env `valueFrom.secretKeyRef` takes its value from `secrets` (env files, the caller's
  environment; see trainguard.spec.secrets) now, into the plan only; a secret (such a
  value, or one whose name looks secret) may not be `$(VAR)`-expanded into the command,
  where every local user could read it.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from trainguard.spec.hyperpod_flags import with_hyperpod_flags
from trainguard.spec.kube import Container
from trainguard.spec.launcher import LauncherError, LauncherLine, parse_launcher
from trainguard.spec.limits import (
    MAX_ARG_BYTES,
    MAX_LOCAL_NODES,
    MAX_LOCAL_NODES_ENV,
    MAX_LOCAL_WORKERS,
    MAX_LOCAL_WORKERS_ENV,
    MAX_NPROC_PER_NODE,
    MAX_WORLD_SIZE,
    describe_bytes,
    local_limit,
)
from trainguard.spec.load import SpecError
from trainguard.spec.model import ReplicaSpec, TrainingJob
from trainguard.spec.pytorchjob import as_written
from trainguard.spec.secrets import SecretSource, looks_secret

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
    env: dict[str, str] = field(repr=False)  # may hold secrets: never shown
    working_dir: str | None
    ignored_flags: tuple[str, ...] = ()  # launcher flags dropped (trainguard decides those)
    max_replicas: int | None = None  # the most nodes of this group when the job scales up


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
    # Where ``max_restarts`` was set, as messages name it: the spec's field, or
    # ``--max-restarts`` (torchrun's flags, or a launcher line in the command).
    max_restarts_from: str = "spec.runPolicy.jobMaxRetryCount"

    @property
    def nnodes(self) -> int:
        """Total nodes across groups (spares not included)."""
        return sum(group.replicas for group in self.groups)

    @property
    def world_size(self) -> int:
        """Total workers (ranks)."""
        return self.nnodes * self.nproc_per_node


def resolve_plan(job: TrainingJob, source: str, secrets: SecretSource | None = None) -> JobPlan:
    """Resolve `job` into a `JobPlan`; raises SpecError (naming `source`) when it cannot.

    `secrets`: where env `valueFrom.secretKeyRef` keys are found (default: nowhere)."""
    try:
        return _resolve_plan(job, source, secrets)
    except SpecError as err:  # a converted PyTorchJob's fields by their own names
        groups = [group.name for group in job.spec.replica_specs]
        problems = as_written(job.metadata.annotations, groups, err.problems)
        raise SpecError(source, problems) from None


def _resolve_plan(job: TrainingJob, source: str, secrets: SecretSource | None) -> JobPlan:
    spec = job.spec
    groups: list[NodeGroupPlan] = []
    launchers: list[tuple[str, LauncherLine]] = []
    for index, replica_spec in enumerate(spec.replica_specs):
        try:
            group, launcher = _group_plan(
                replica_spec, f"spec.replicaSpecs[{index}]", source, secrets or SecretSource()
            )
        except _TooLong as err:
            where = f"spec.replicaSpecs[{index}].template.spec.containers[0]"
            raise SpecError(source, [(where, str(err))]) from None
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
    nproc_per_node = resolve_nproc_per_node(nproc or DEFAULT_NPROC_PER_NODE, source)
    world_size = nproc_per_node * sum(group.replicas for group in groups)
    if world_size > MAX_WORLD_SIZE:
        problem = f"{world_size} ranks in all; a job has at most {MAX_WORLD_SIZE}"
        raise SpecError(source, [("spec.nprocPerNode", problem)])
    # hyperpodrun's own flags in the launcher lines become spec.trainguard options.
    job = with_hyperpod_flags(job, [(where, line.hyperpod) for where, line in launchers], source)
    options = job.spec.trainguard
    by_flag = source == "command line" or (  # torchrun's flags, or a launcher line's
        spec.run_policy.job_max_retry_count is None
        and any(line.max_restarts is not None for _, line in launchers)
    )
    return JobPlan(
        name=job.metadata.name,
        nproc_per_node=nproc_per_node,
        groups=tuple(groups),
        max_restarts=max_restarts or 0,
        active_deadline_seconds=spec.run_policy.active_deadline_seconds,
        stop_grace_seconds=(
            0.0 if options.shutdown_signal == "SIGKILL" else options.stop_grace_period_seconds
        ),
        poll_interval_seconds=options.poll_interval_seconds,
        node_start_timeout_seconds=options.node_start_timeout_seconds,
        job=job,
        max_restarts_from="--max-restarts" if by_flag else "spec.runPolicy.jobMaxRetryCount",
    )


def resolve_nproc_per_node(value: str, source: str) -> int:
    """Resolve auto | cpu | gpu | a numeric string to a number of workers per node."""
    if value.isdigit():
        if len(value) > 9 or int(value) > MAX_NPROC_PER_NODE:
            raise SpecError(source, [("spec.nprocPerNode", f"must be <= {MAX_NPROC_PER_NODE}")])
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
    replica_spec: ReplicaSpec, where: str, source: str, secrets: SecretSource
) -> tuple[NodeGroupPlan, LauncherLine | None]:
    container = replica_spec.template.spec.containers[0]
    here = f"{where}.template.spec.containers[0]"
    env, hidden = _container_env(container, here, source, secrets)
    _no_secret_in_argv(container, hidden, here, source)
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
        max_replicas=replica_spec.max_replicas,
    )
    return group, launcher


def _container_env(
    container: Container, here: str, source: str, secrets: SecretSource
) -> tuple[dict[str, str], set[str]]:
    """The container's env, `valueFrom.secretKeyRef` resolved from `secrets`; and the names
    of the secrets in it (resolved ones, and names that look secret)."""
    problems: list[tuple[str, str]] = []
    if (container.model_extra or {}).get("envFrom"):
        problems.append((f"{here}.envFrom", "not supported by the local platform"))
    env: dict[str, str] = {}
    hidden: set[str] = set()
    for index, var in enumerate(container.env):
        if var.value_from is None:
            raw = var.value or ""
            if looks_secret(var.name) or any(n in hidden for n in _VAR_REF.findall(raw)):
                hidden.add(var.name)  # a secret, or made of one
            env[var.name] = _expand(raw, env)
            continue
        where = f"{here}.env[{index}].valueFrom"
        ref = var.value_from.secret_key_ref
        if ref is None:
            problems.append((where, "not supported by the local platform (only secretKeyRef)"))
            continue
        value = secrets.lookup(ref.key)
        if value is None:
            problems.append(
                (f"{where}.secretKeyRef.key", f"{var.name}: {ref.key!r} is in none of: "
                 f"{secrets.places()}")
            )  # fmt: skip
            continue
        env[var.name] = value
        hidden.add(var.name)
    if problems:
        raise SpecError(source, problems)
    return env, hidden


def _no_secret_in_argv(container: Container, hidden: set[str], here: str, source: str) -> None:
    """A `$(VAR)` of a secret would put it on the workers' command line (`ps`): refused."""
    problems: list[tuple[str, str]] = []
    for part in ("command", "args"):
        for index, arg in enumerate(getattr(container, part)):
            for match in _VAR_REF.finditer(arg):
                name = match.group(1)
                if name in hidden:
                    problems.append(
                        (f"{here}.{part}[{index}]", f"$({name}) would put a secret on the "
                         f"workers' command line, which every local user can read (ps); "
                         f"read ${name} from the environment instead")
                    )  # fmt: skip
    if problems:
        raise SpecError(source, problems)


class _TooLong(ValueError):
    """A `$(VAR)` expansion past MAX_ARG_BYTES (each variable doubling the last: a bomb)."""


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, `$$` is a literal `$`.

    Raises _TooLong before building a result longer than MAX_ARG_BYTES (execve refuses
    longer arguments and variables anyway)."""
    budget = MAX_ARG_BYTES - len(text)

    def replace(match: re.Match[str]) -> str:
        nonlocal budget
        name = match.group(1)
        if name is None:
            return "$"
        value = env.get(name, match.group(0))
        budget -= len(value)
        if budget < 0:
            limit = describe_bytes(MAX_ARG_BYTES)
            raise _TooLong(f"$({name}): longer than {limit} once $(VAR) references are expanded")
        return value

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


def check_local_size(plan: JobPlan, source: str) -> None:
    """Refuse a plan too big for one machine (`trainguard run`): every node is an agent
    process (about 0.6 GB with torch imported) and every worker a process. The limits
    (`limits.MAX_LOCAL_NODES`, `MAX_LOCAL_WORKERS`) are raised through their variables."""
    from_cli = source == "command line"
    spares = sum(group.spares for group in plan.groups)
    most = local_limit(MAX_LOCAL_NODES_ENV, MAX_LOCAL_NODES)
    if plan.nnodes + spares > most:
        field = "--nnodes" if from_cli else "spec.replicaSpecs"
        count = f"{plan.nnodes + spares} nodes" + (" (spares included)" if spares else "")
        problem = (
            f"{count} is more than one machine runs: at most {most} locally, each an agent "
            f"process of about 0.6 GB; set {MAX_LOCAL_NODES_ENV} to raise the limit"
        )
        raise SpecError(source, [(field, problem)])
    hot_spares = plan.job.spec.trainguard.hot_spares
    most = local_limit(MAX_LOCAL_WORKERS_ENV, MAX_LOCAL_WORKERS)
    if plan.world_size + hot_spares > most:
        field = "--nproc-per-node" if from_cli else "spec.nprocPerNode"
        count = f"{plan.world_size + hot_spares} worker processes" + (
            " (hot spares included)" if hot_spares else ""
        )
        problem = (
            f"{count} is more than one machine runs: at most {most} locally; set "
            f"{MAX_LOCAL_WORKERS_ENV} to raise the limit"
        )
        raise SpecError(source, [(field, problem)])
