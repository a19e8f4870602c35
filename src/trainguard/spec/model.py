"""The `TrainingJob` model: one YAML describes a job, locally and on Kubernetes.

Field names follow SageMaker HyperPod's `HyperPodPyTorchJob` (camelCase in YAML/JSON,
snake_case attributes in Python). trainguard's own settings live in `spec.trainguard`.

The Kubernetes objects inside (metadata, pod template) are in `kube.py`; shared field
types and checks in `fields.py`.

Conventions: counts are integers, durations are seconds as numbers (fractions allowed,
so tests can use short timers); every count has an upper limit and every duration is
finite, with a maximum (`limits.py`). Unknown fields are errors everywhere except inside
a replica's pod `template`, which is a Kubernetes object and is preserved as given.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field, field_validator, model_validator

from trainguard.monitor.regex import compile_regex
from trainguard.spec.checkpointing import Checkpointing
from trainguard.spec.elastic import ElasticPolicy
from trainguard.spec.fields import (
    DNS_LABEL_HELP,
    DnsName,
    ModuleName,
    NonNegativeSeconds,
    NprocPerNode,
    Regex,
    Seconds,
    SpecModel,
    field_problem,
)
from trainguard.spec.health import HealthOptions
from trainguard.spec.kube import ObjectMeta, PodTemplateSpec
from trainguard.spec.limits import (
    MAX_DATA_POINTS,
    MAX_DURATION_SECONDS,
    MAX_GRACE_SECONDS,
    MAX_HOT_SPARES,
    MAX_LOG_RULES,
    MAX_NODES,
    MAX_POLL_INTERVAL_SECONDS,
    MAX_RATIO,
    MAX_RESTARTS,
)
from trainguard.spec.logs import LogOptions

__all__ = [
    "API_VERSION",
    "KIND",
    "WORKLOAD_MODES",
    "LogRule",
    "ReplicaSpec",
    "RestartPolicy",
    "RunPolicy",
    "TrainguardOptions",
    "TrainingJob",
    "TrainingJobSpec",
]

API_VERSION: Final = "trainguard.dev/v1"
KIND: Final = "TrainingJob"

# Defaults of trainguard's own settings (spec.trainguard), kept in one place.
DEFAULT_STOP_GRACE_PERIOD_SECONDS = 10.0
DEFAULT_POLL_INTERVAL_SECONDS = 0.5
DEFAULT_NODE_START_TIMEOUT_SECONDS = 60.0
DEFAULT_CONTROLLER_GRACE_SECONDS = 300.0
MAX_CONTROLLER_GRACE_SECONDS = 7 * 24 * 3600.0
DEFAULT_STRAGGLER_THRESHOLD = 1.3
DEFAULT_STRAGGLER_WINDOW = 20
DEFAULT_EXIT_HANG_TIMEOUT_SECONDS = 60.0  # trainguard.control.exit_hang.DEFAULT_TIMEOUT
DEFAULT_PARTITION_TIMEOUT_SECONDS = 60.0
DEFAULT_MAX_REQUEUES = 3
MAX_REQUEUES = 1000
DEFAULT_NO_PROGRESS_TIMEOUT_SECONDS = 60.0  # trainguard.control.no_progress.DEFAULT_TIMEOUT
HOSTS_NODE_LOST_AFTER_SECONDS = 8.0  # nodeLostAfterSeconds across hosts, unless set
MAX_STRAGGLER_WINDOW = 10_000


class ReplicaSpec(SpecModel):
    """A group of identical nodes (pods), each running `nprocPerNode` workers."""

    name: DnsName = Field(description="Group name, " + DNS_LABEL_HELP + ".")
    replicas: int = Field(
        default=1, ge=1, le=MAX_NODES, description="Number of nodes in this group."
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NODES,
        description="Upper bound on nodes when the job scales elastically.",
    )
    spares: int = Field(
        default=0, ge=0, le=MAX_NODES, description="Spare nodes kept ready to replace a faulty one."
    )
    template: PodTemplateSpec = Field(description="Pod template of every node in the group.")

    @model_validator(mode="after")
    def _max_at_least_replicas(self) -> ReplicaSpec:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise field_problem("maxReplicas", f"must be >= replicas ({self.replicas})")
        return self


class RestartPolicy(SpecModel):
    """Limits on restarts within an evaluation window (HyperPod semantics)."""

    eval_period_seconds: Seconds = Field(
        description="Length of the window in which restarts are counted."
    )
    num_restart_before_full_job_restart: int | None = Field(
        default=None,
        ge=0,
        le=MAX_RESTARTS,
        description="Process-level restarts allowed in the window before escalating to a "
        "full job restart. Unset: the control plane's default.",
    )
    max_full_job_restarts: int | None = Field(
        default=None,
        ge=0,
        le=MAX_RESTARTS,
        description="Full job restarts allowed over the whole job before it fails. "
        "Unset: bounded only by jobMaxRetryCount.",
    )
    max_num_repeat_offenders_to_avoid: int | None = Field(
        default=None,
        ge=0,
        le=MAX_NODES,
        description="How many repeatedly faulty nodes to avoid when restarting the full job.",
    )
    scale_up_snooze_time_in_seconds: NonNegativeSeconds | None = Field(
        default=None, description="Wait before scaling back up after a fault."
    )


Operator = Literal["gt", "lt", "eq", "gteq", "lteq"]

WORKLOAD_MODES: Final[tuple[str, ...]] = ()
"""``runPolicy.workloadMode`` values trainguard runs: none yet. HyperPod's SDK has the field
(a string) but the reference this project keeps of it names no values, and a mode that
changes how pods are deployed must not be ignored."""


class LogRule(SpecModel):
    """A log monitoring rule: detects a hanging, slow or faulty job from worker output."""

    name: str = Field(min_length=1, description="Rule name; appears in fault reasons.")
    log_pattern: Regex = Field(
        description="Regex (RE2 syntax: linear-time, no backreferences or lookaround) matched "
        "like re.match (anchored at line start) against every output line of every rank; its "
        "first group is the metric when metricThreshold is set.",
    )
    expected_start_cut_off_in_seconds: Seconds | None = Field(
        default=None, description="HANGING if nothing matches this long after the start."
    )
    expected_recurring_frequency_in_seconds: Seconds | None = Field(
        default=None, description="HANGING if the gap between two matches exceeds this."
    )
    stop_pattern: Regex | None = Field(
        default=None, description="Regex (RE2 syntax); a matching line switches the rule off."
    )
    metric_threshold: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="Threshold for the metric; requires operator. An integer (as HyperPod's "
        "schema has it) or a number with a fraction.",
    )
    operator: Operator | None = Field(
        default=None,
        description="The bad condition, metric <operator> metricThreshold "
        "(e.g. lteq 80 samples/sec); requires metricThreshold.",
    )
    metric_evaluation_data_points: int = Field(
        default=1,
        ge=1,
        le=MAX_DATA_POINTS,
        description="Consecutive bad samples before the rule reports SLOW.",
    )
    fault_on_match: bool = Field(default=False, description="A match is a fault by itself.")

    @model_validator(mode="after")
    def _threshold_needs_operator(self) -> LogRule:
        if self.metric_threshold is not None and self.operator is None:
            raise field_problem("operator", "required when metricThreshold is set")
        if self.operator is not None and self.metric_threshold is None:
            raise field_problem("metricThreshold", "required when operator is set")
        if self.metric_threshold is not None and compile_regex(self.log_pattern).groups < 1:
            raise field_problem(
                "logPattern", "needs a capture group for the metric when metricThreshold is set"
            )
        return self


class RunPolicy(SpecModel):
    """How the job runs, retries and ends."""

    job_max_retry_count: int | None = Field(
        default=None,
        ge=0,
        le=MAX_RESTARTS,
        description="Restarts allowed before the job fails. Unset: the launcher's "
        "--max-restarts if the command is a launcher line, else 0.",
    )
    restart_policy: RestartPolicy | None = Field(
        default=None, description="Restart limits per evaluation window."
    )
    log_monitoring_configuration: list[LogRule] = Field(
        default_factory=list,
        max_length=MAX_LOG_RULES,
        description="Log monitoring rules, applied to every rank.",
    )
    active_deadline_seconds: Seconds | None = Field(
        default=None, description="The job fails when it has been active longer than this."
    )
    ttl_seconds_after_finished: float | None = Field(
        default=None,
        ge=-1,
        le=MAX_DURATION_SECONDS,
        allow_inf_nan=False,
        description="Delete a finished job after this long (-1: never).",
    )
    clean_pod_policy: Literal["All", "OnlyComplete", "None"] = Field(
        default="All", description="Which pods (nodes) to remove when the job finishes."
    )
    suspend: bool = Field(default=False, description="Suspended jobs do not run.")
    startup_deadline_seconds: Seconds | None = Field(
        default=None, description="The job fails if it is not running within this."
    )
    fault_deadline_seconds: Seconds | None = Field(
        default=None, description="The job fails if it stays faulted longer than this."
    )
    workload_mode: str | None = Field(
        default=None,
        description="HyperPod's workload deployment mode for elastic training. Refused: no "
        "mode's values or meaning are known to trainguard yet, so a spec that names one fails "
        "rather than run differently from what it asks for.",
    )

    @field_validator("workload_mode")
    @classmethod
    def _known_workload_mode(cls, mode: str | None) -> str | None:
        if mode is not None and mode not in WORKLOAD_MODES:
            raise ValueError(
                f"{mode!r} is not a workload mode trainguard runs (it runs none of HyperPod's "
                "yet); remove the field"
            )
        return mode

    @field_validator("log_monitoring_configuration")
    @classmethod
    def _unique_rule_names(cls, rules: list[LogRule]) -> list[LogRule]:
        seen: set[str] = set()
        for rule in rules:
            if rule.name in seen:
                raise ValueError(f"duplicate rule name {rule.name!r}")
            seen.add(rule.name)
        return rules


class TrainguardOptions(SpecModel):
    """trainguard extensions (not part of HyperPod's schema)."""

    stop_grace_period_seconds: float = Field(
        default=DEFAULT_STOP_GRACE_PERIOD_SECONDS,
        ge=0,
        le=MAX_GRACE_SECONDS,
        allow_inf_nan=False,
        description="trainguard extension: time workers get after SIGTERM before SIGKILL.",
    )
    shutdown_signal: Literal["SIGTERM", "SIGKILL"] | None = Field(
        default=None,
        description="trainguard extension (hyperpodrun's --shutdown-signal): the signal "
        "that stops workers, at every stop. SIGTERM: SIGKILL follows after "
        "stopGracePeriodSeconds (hyperpodrun's --shutdown-timeout), a fault's restart "
        "included; SIGKILL: at once. Unset: a requested stop is SIGTERM then SIGKILL after "
        "stopGracePeriodSeconds, a fault's restart SIGKILL at once.",
    )
    pre_train_script: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="trainguard extension (hyperpodrun's --pre-train-script and "
        "--pre-train-args): a command (argv, run without a shell in the workers' directory "
        "and environment) every node runs before it starts its workers, at every start; "
        "its failure is a node fault whose message ends with the command's output.",
    )
    post_train_script: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="trainguard extension (hyperpodrun's --post-train-script and "
        "--post-train-args): a command every node runs once all its workers exited 0; its "
        "failure is a node fault whose message ends with the command's output.",
    )
    poll_interval_seconds: float = Field(
        default=DEFAULT_POLL_INTERVAL_SECONDS,
        gt=0,
        le=MAX_POLL_INTERVAL_SECONDS,
        allow_inf_nan=False,
        description="trainguard extension: how often the controller polls node agents "
        "(on one machine, every 2 s or this when longer, while every rank trains and no "
        "hang timer is near: agents push every change at once).",
    )
    node_start_timeout_seconds: Seconds = Field(
        default=DEFAULT_NODE_START_TIMEOUT_SECONDS,
        description="trainguard extension: a node agent that is not ready within this is faulty.",
    )
    heartbeat_timeout_seconds: Seconds | None = Field(
        default=None,
        description="trainguard extension: a rank that called trainguard.heartbeat() and then "
        "sent none for this long is hanging. Unset: heartbeats are not checked.",
    )
    exit_hang_timeout_seconds: Seconds | None = Field(
        default=DEFAULT_EXIT_HANG_TIMEOUT_SECONDS,
        description="trainguard extension: a rank still running this long after every other "
        "rank of the attempt exited 0 (or 20 of the attempt's mean step times, if longer), "
        "using no CPU meanwhile, is an ExitHang: its stacks are captured and it is ended; the "
        "job succeeds when its work was done (its last step, if it reported one, is the "
        "others'). null: never.",
    )
    no_progress_timeout_seconds: Seconds | None = Field(
        default=DEFAULT_NO_PROGRESS_TIMEOUT_SECONDS,
        description="trainguard extension: a job that has printed progress (Step N lines, "
        "or heartbeats with a step) and then prints none for this long, or 10 of its mean "
        "step times if longer, is hung: a NoProgress fault, its stacks captured, with no log "
        "rule needed. null: never.",
    )
    node_lost_after_seconds: Seconds | None = Field(
        default=None,
        description="trainguard extension: a node whose agent did not answer 3 contacts in a "
        "row, over at least this many seconds, is lost. Unset: the 3 contacts alone on one "
        "machine; 8 s across hosts, where each node's agent also stops writing to the durable "
        "tier after half of it without a word from the controller (it may be declared lost).",
    )
    partition_timeout_seconds: Seconds = Field(
        default=DEFAULT_PARTITION_TIMEOUT_SECONDS,
        description="trainguard extension: across hosts, a host that cannot reach the "
        "controller for this long stops its workers (a cut-off node that trained on would be "
        "a second copy of the job) and joins again as a new host.",
    )
    max_requeues: int = Field(
        default=DEFAULT_MAX_REQUEUES,
        ge=0,
        le=MAX_REQUEUES,
        description="trainguard extension: under Slurm, how many times a job requeues itself "
        "(scontrol requeue) when its allocation can no longer hold it; counted by "
        "SLURM_RESTART_COUNT. The requeued run resumes from the newest durable checkpoint.",
    )
    drain_nodes: bool = Field(
        default=True,
        description="trainguard extension: under Slurm, drain a node that is lost or fails a "
        "health check (scontrol update state=drain, with a reason naming trainguard and the "
        "fault), so no job is scheduled on it until an administrator resumes it. Needs "
        "Slurm's operator rights; without them a warning says so and the job goes on.",
    )
    progress_pattern: Regex | None = Field(
        default=None,
        description="trainguard extension: regex (RE2 syntax, anchored like re.match) whose "
        "first group is the completed training step in a worker's output line. Unset: lines "
        "such as "
        "'Batch 41 ...', 'Step 41 ...' or 'Iteration 41 ...'.",
    )
    in_process_restart: bool = Field(
        default=False,
        description="trainguard extension: after a worker crash, keep the other workers' "
        "processes and rebuild the process group in them (the script adopts "
        "trainguard.resilient); a dead rank is replaced by a hot spare or a new process, and "
        "takes its state from a healthy peer. Other faults restart processes as usual.",
    )
    hot_spares: int = Field(
        default=0,
        ge=0,
        le=MAX_HOT_SPARES,
        description="trainguard extension: warm standby worker processes (script loaded, "
        "waiting) that take over a dead rank in an in-process restart; placed one per node, "
        "round robin from node 0.",
    )
    warm_start: bool = Field(
        default=True,
        description="trainguard extension: fork Python workers, at every start and process "
        "restart, from a per-node template process that has already imported torch and the "
        "script's other installed modules, instead of starting a fresh interpreter. Off: "
        "every worker is a fresh `python` process.",
    )
    preload_modules: list[ModuleName] = Field(
        default_factory=list,
        max_length=64,
        description="trainguard extension: modules the worker template imports too (besides "
        "torch and the installed modules the script imports, found by reading it).",
    )
    restart_barrier_timeout_seconds: Seconds = Field(
        default=60.0,
        description="trainguard extension: how long every rank has to rejoin after an "
        "in-process restart; a rank that does not falls back to a process-level restart.",
    )
    controller_grace_seconds: float = Field(
        default=DEFAULT_CONTROLLER_GRACE_SECONDS,
        ge=0,
        le=MAX_CONTROLLER_GRACE_SECONDS,
        allow_inf_nan=False,
        description="trainguard extension: when `trainguard run` dies (killed, crashed), its "
        "node agents keep the workers training this long for `trainguard resume` to "
        "re-attach; then they stop them and free the memory tier. 0: they stop at once.",
    )
    straggler_threshold: float | None = Field(
        default=DEFAULT_STRAGGLER_THRESHOLD,
        gt=1,
        le=MAX_RATIO,
        allow_inf_nan=False,
        description="trainguard extension: a rank whose seconds per step, over its last "
        "stragglerWindow steps, reach this many times the job's median is a straggler "
        "(a Straggler event). null: stragglers are not reported.",
    )
    straggler_window: int = Field(
        default=DEFAULT_STRAGGLER_WINDOW,
        ge=2,
        le=MAX_STRAGGLER_WINDOW,
        description="trainguard extension: how many of its latest steps a rank's step time "
        "is measured over (from its progress lines, or heartbeats that give a step).",
    )
    straggler_action: Literal["report", "restart"] = Field(
        default="report",
        description="trainguard extension: what a straggler causes: report (an event), or "
        "restart (also a Straggler fault: every rank stops, and its node is replaced, by a "
        "spare when one is left).",
    )
    logs: LogOptions = Field(
        default_factory=LogOptions,
        description="trainguard extension: each rank's log cap on disk and its rotations.",
    )
    health_checks: HealthOptions = Field(
        default_factory=HealthOptions,
        description="trainguard extension: deep checks before a node takes ranks, and the "
        "monitors that watch it while it works.",
    )

    @model_validator(mode="after")
    def _spares_need_in_process_restart(self) -> TrainguardOptions:
        if self.hot_spares and not self.in_process_restart:
            raise ValueError("hotSpares needs inProcessRestart: true")
        return self


class TrainingJobSpec(SpecModel):
    """What to run, on how many nodes, and how to react to faults."""

    nproc_per_node: NprocPerNode | None = Field(
        default=None,
        description="Workers per node: auto | cpu | gpu | a positive integer. Unset: the "
        "launcher's --nproc-per-node if the command is a launcher line, else 1.",
    )
    replica_specs: list[ReplicaSpec] = Field(
        min_length=1, description="Node groups; together they form the job's nodes."
    )
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="Retries, deadlines and log monitoring."
    )
    elastic_policy: ElasticPolicy | None = Field(
        default=None,
        description="Elastic scaling: bounds, sizes, timeouts (HyperPod's elasticPolicy).",
    )
    trainguard: TrainguardOptions = Field(
        default_factory=TrainguardOptions,
        description="trainguard extensions: settings HyperPod does not have.",
    )
    checkpointing: Checkpointing = Field(
        default_factory=Checkpointing,
        description="trainguard extension: checkpoint tiers for trainguard.checkpoint.",
    )

    @field_validator("replica_specs")
    @classmethod
    def _unique_group_names(cls, groups: list[ReplicaSpec]) -> list[ReplicaSpec]:
        seen: set[str] = set()
        for group in groups:
            if group.name in seen:
                raise ValueError(f"duplicate replica spec name {group.name!r}")
            seen.add(group.name)
        nodes = sum(group.replicas + group.spares for group in groups)
        if nodes > MAX_NODES:
            raise ValueError(f"{nodes} nodes with spares; a job has at most {MAX_NODES}")
        return groups

    @model_validator(mode="after")
    def _elastic_bounds_hold_the_job(self) -> TrainingJobSpec:
        policy = self.elastic_policy
        if policy is None:
            return self
        total = sum(group.replicas for group in self.replica_specs)
        if policy.min_replicas is not None and policy.min_replicas > total:
            raise field_problem(
                "elasticPolicy.minReplicas", f"must be <= the job's replicas ({total})"
            )
        if policy.max_replicas is not None and policy.max_replicas < total:
            raise field_problem(
                "elasticPolicy.maxReplicas", f"must be >= the job's replicas ({total})"
            )
        return self


class TrainingJob(SpecModel):
    """A training job (apiVersion trainguard.dev/v1, kind TrainingJob)."""

    api_version: Literal["trainguard.dev/v1"] = Field(
        default=API_VERSION, description="Always trainguard.dev/v1."
    )
    kind: Literal["TrainingJob"] = Field(default=KIND, description="Always TrainingJob.")
    metadata: ObjectMeta = Field(description="Name, namespace, labels and annotations.")
    spec: TrainingJobSpec = Field(description="The job.")
