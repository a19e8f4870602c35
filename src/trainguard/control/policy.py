"""The restart decision: after a failed attempt, restart at which scope, on which nodes, or give up.

:func:`decide_restart` is a pure function of the attempt's faults, the job's restart history,
the fault times per node and the available spares. It follows HyperPod's ``restartPolicy``:

1. **Retry budget.** When the restarts so far (``len(history)``) reach ``jobMaxRetryCount``,
   give up. Every restart, of either scope, counts.
2. **Unusable nodes.** A fault that makes its node unusable (:data:`NODE_FAULTS`: the agent
   is lost, did not stop or refused the start, or one of its ranks straggled) requires a
   full job restart that replaces the node: by a spare if one is left (in the order
   given), otherwise by a fresh node with the same id (locally: a new agent process).
   Every other fault type is process-scope.
3. **Escalation.** Process-level restarts are counted within the last ``evalPeriodSeconds``
   (the whole job when unset), and only those after the most recent full job restart: a
   full restart starts the ladder afresh. When that count reaches
   ``numRestartBeforeFullJobRestart``, the next restart is a full job restart (0: every
   restart is; unset: never escalate on count).
4. **Full job restart budget.** Full job restarts over the whole job are bounded by
   ``maxFullJobRestarts`` (unset: by ``jobMaxRetryCount`` only). When rule 2 or 3 needs one
   and none is left, give up.
5. **Repeat offenders.** A node with at least ``repeat_offender_faults`` faults within the
   window is an offender; faults at the same instant count once (several ranks of one node
   failing together are one incident). On a full job restart, offenders are swapped for
   spares, worst first (those that faulted in this attempt, then most faults, then node
   rank), at most
   ``maxNumRepeatOffendersToAvoid`` of them and only while spares remain; nodes already
   replaced by rule 2 do not count. Offenders that stay are named in the reason.
6. **An offender alone forces a full job restart** when it faulted in this attempt, a spare
   is left, ``maxNumRepeatOffendersToAvoid`` > 0 and the full job restart budget allows it:
   restarting processes on a node that keeps failing would likely fail again. Without a
   spare (or budget), it is a process-level restart whose reason says why the offender stays.
7. Otherwise: a process-level restart on the same nodes.

``history`` is oldest first. Windows include their edge: a restart or fault at exactly
``now - evalPeriodSeconds`` is inside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Final

from trainguard.control.events import Fault, FaultType

if TYPE_CHECKING:
    from trainguard.spec.model import RunPolicy

__all__ = [
    "DEFAULT_BUDGET_NAME",
    "DEFAULT_MAX_NUM_REPEAT_OFFENDERS_TO_AVOID",
    "DEFAULT_NUM_RESTART_BEFORE_FULL_JOB_RESTART",
    "DEFAULT_REPEAT_OFFENDER_FAULTS",
    "NODE_FAULTS",
    "GiveUp",
    "PolicyConfig",
    "Restart",
    "RestartRecord",
    "RestartScope",
    "decide_restart",
    "fault_cause",
]

# Defaults for restartPolicy fields left unset, in one place.
DEFAULT_NUM_RESTART_BEFORE_FULL_JOB_RESTART: Final[int | None] = None  # never escalate on count
DEFAULT_MAX_NUM_REPEAT_OFFENDERS_TO_AVOID: Final = 0  # avoid no node unless asked
DEFAULT_REPEAT_OFFENDER_FAULTS: Final = 2
DEFAULT_BUDGET_NAME: Final = "jobMaxRetryCount"

NODE_FAULTS: Final = frozenset(t for t in FaultType if t.loses_node)
"""Fault types after which the node cannot be used again as it is: it must be replaced."""


class RestartScope(StrEnum):
    # Survivors keep their processes; dead ranks are replaced (hot spare or new process).
    IN_PROCESS = "in-process"
    PROCESS = "process"  # stop all workers, start them again on the same nodes (HyperPod: PLR)
    JOB = "job"  # replace the node agents (locally) / re-create pods (k8s) (HyperPod: JLR)

    @property
    def hyperpod(self) -> str:
        """HyperPod's name for it (``restartType`` in the job status), PLR or JLR, the two
        it has: an in-process restart, which restarts some ranks' processes and keeps the
        pods, is a PLR; only a job-level restart (new pods) is a JLR."""
        return {"in-process": "PLR", "process": "PLR", "job": "JLR"}[self.value]


@dataclass(frozen=True)
class PolicyConfig:
    """The limits :func:`decide_restart` applies; see the module docstring for the rules."""

    job_max_retry_count: int
    num_restart_before_full_job_restart: int | None
    eval_period_seconds: float | None
    max_full_job_restarts: int | None
    max_num_repeat_offenders_to_avoid: int
    repeat_offender_faults: int = DEFAULT_REPEAT_OFFENDER_FAULTS
    # What the user set the retry budget with, as its messages name it: the spec's field,
    # or ``--max-restarts`` for a job from torchrun's flags (``budget_name=N`` in reasons).
    budget_name: str = DEFAULT_BUDGET_NAME

    def __post_init__(self) -> None:
        _at_least("jobMaxRetryCount", self.job_max_retry_count, 0)
        _at_least("numRestartBeforeFullJobRestart", self.num_restart_before_full_job_restart, 0)
        _at_least("maxFullJobRestarts", self.max_full_job_restarts, 0)
        _at_least("maxNumRepeatOffendersToAvoid", self.max_num_repeat_offenders_to_avoid, 0)
        _at_least("repeat_offender_faults", self.repeat_offender_faults, 1)
        period = self.eval_period_seconds
        if period is not None and not period > 0:
            raise ValueError(f"evalPeriodSeconds: must be > 0, got {period!r}")

    @classmethod
    def from_spec(
        cls,
        run_policy: RunPolicy | None,
        max_restarts: int,
        budget_name: str = DEFAULT_BUDGET_NAME,
    ) -> PolicyConfig:
        """The policy of a job spec.

        ``max_restarts`` is the resolved ``jobMaxRetryCount`` (the plan's, which may come from
        a launcher's ``--max-restarts``); ``run_policy.jobMaxRetryCount`` is not read;
        ``budget_name``: where the user set it (messages name it so). Unset
        fields: no ``restartPolicy`` means no window, no escalation on count, no limit on
        full job restarts but the retry budget, and no offender avoidance; inside a
        ``restartPolicy``, the ``DEFAULT_*`` constants of this module apply.
        """
        restart = run_policy.restart_policy if run_policy is not None else None
        if restart is None:
            return cls(
                job_max_retry_count=max_restarts,
                num_restart_before_full_job_restart=DEFAULT_NUM_RESTART_BEFORE_FULL_JOB_RESTART,
                eval_period_seconds=None,
                max_full_job_restarts=None,
                max_num_repeat_offenders_to_avoid=DEFAULT_MAX_NUM_REPEAT_OFFENDERS_TO_AVOID,
                budget_name=budget_name,
            )
        num = restart.num_restart_before_full_job_restart
        avoid = restart.max_num_repeat_offenders_to_avoid
        return cls(
            job_max_retry_count=max_restarts,
            num_restart_before_full_job_restart=(
                DEFAULT_NUM_RESTART_BEFORE_FULL_JOB_RESTART if num is None else num
            ),
            eval_period_seconds=restart.eval_period_seconds,
            max_full_job_restarts=restart.max_full_job_restarts,
            max_num_repeat_offenders_to_avoid=(
                DEFAULT_MAX_NUM_REPEAT_OFFENDERS_TO_AVOID if avoid is None else avoid
            ),
            budget_name=budget_name,
        )


@dataclass(frozen=True)
class RestartRecord:
    """One earlier restart of the job: when it was decided, and its scope."""

    time: float
    scope: RestartScope


@dataclass(frozen=True)
class Restart:
    """Restart the job: ``nodes`` are the next attempt's node ids, in node-rank order.

    On a JOB restart every node's agent (pod) is replaced; ``replaced`` lists the nodes
    swapped for spares (old id -> spare id). It is empty for PROCESS restarts.
    """

    scope: RestartScope
    nodes: tuple[str, ...]
    replaced: dict[str, str]
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """Fail the job; ``reason`` names the cause and the exhausted budget."""

    reason: str


def decide_restart(
    now: float,
    faults: Sequence[Fault],
    history: Sequence[RestartRecord],
    node_fault_times: Mapping[str, Sequence[float]],
    nodes: Sequence[str],
    spares: Sequence[str],
    config: PolicyConfig,
) -> Restart | GiveUp:
    """What to do after an attempt ended with ``faults`` (at least one).

    ``history``: earlier restarts, oldest first. ``node_fault_times``: every fault time per
    node id, this attempt's included. ``nodes``: the ended attempt's node ids in node-rank
    order. ``spares``: unused spare node ids, in the order they should be taken.
    """
    _check_inputs(faults, nodes, spares)
    cause = fault_cause(faults)
    restarts = len(history)
    allowed = f"{config.budget_name}={config.job_max_retry_count}"
    if restarts >= config.job_max_retry_count:
        return GiveUp(f"{cause}; retry budget exhausted ({allowed}, restarts={restarts})")
    budget = f"restart {restarts + 1} of {allowed}"
    window = _window_text(config)
    lost = _lost_nodes(faults, nodes)
    faulting = {f.node for f in faults if f.node is not None}
    offenders = _offenders(now, node_fault_times, nodes, faulting, config)
    recent = _recent_process_restarts(now, history, config)
    full_done = sum(1 for r in history if r.scope is RestartScope.JOB)
    full_max = config.max_full_job_restarts
    full_left = full_max is None or full_done < full_max

    why_job: list[str] = []
    if lost:
        types = ", ".join(sorted({str(f.type) for f in faults if f.node in lost}))
        why_job.append(f"{', '.join(lost)} unusable after {types}")
    escalate = config.num_restart_before_full_job_restart
    if escalate is not None and recent >= escalate:
        why_job.append(
            f"{_plural(recent, 'process-level restart')} {window} reached "
            f"numRestartBeforeFullJobRestart={escalate}"
        )
    if why_job and not full_left:
        return GiveUp(
            f"{cause}; {'; '.join(why_job)}: full job restart budget exhausted "
            f"(maxFullJobRestarts={full_max}, full job restarts={full_done})"
        )

    if not why_job:
        culprits = [(node, count) for node, count in offenders if node in faulting]
        avoid = config.max_num_repeat_offenders_to_avoid
        if not (culprits and spares and avoid > 0 and full_left):
            notes = [budget]
            if escalate is not None:
                notes.append(
                    f"{_plural(recent, 'earlier process-level restart')} {window}, "
                    f"numRestartBeforeFullJobRestart={escalate}"
                )
            if culprits:
                notes.append(_kept_note(culprits, config, bool(spares), full_done))
            reason = f"process-level restart on the same nodes ({'; '.join(notes)})"
            return Restart(RestartScope.PROCESS, tuple(nodes), {}, reason)
        why_job.append(
            f"{_offender_names(culprits[:1], window)} faulted again, "
            f"{_plural(len(spares), 'spare')} left to avoid it"
        )

    if full_max is None:
        full = f"full job restart {full_done + 1} (maxFullJobRestarts unset)"
    else:
        full = f"full job restart {full_done + 1} of maxFullJobRestarts={full_max}"
    why = f"full job restart: {'; '.join(why_job)}"
    return _job_restart(why, lost, offenders, nodes, spares, config, f"{full}; {budget}")


def fault_cause(faults: Sequence[Fault]) -> str:
    """A one-line cause for a set of faults: the first one's message, plus how many more."""
    if not faults:
        return "no fault"
    first = faults[0]
    text = first.message or _describe(first)
    more = len(faults) - 1
    return text + (f" (+{_plural(more, 'more fault')})" if more else "")


# -- the pieces -------------------------------------------------------------


def _job_restart(
    why: str,
    lost: Sequence[str],
    offenders: Sequence[tuple[str, int]],
    nodes: Sequence[str],
    spares: Sequence[str],
    config: PolicyConfig,
    budgets: str,
) -> Restart:
    free = list(spares)
    replaced: dict[str, str] = {}
    notes: list[str] = []
    fresh = []
    for node in lost:
        if free:
            replaced[node] = free.pop(0)
        else:
            fresh.append(node)
    avoid = config.max_num_repeat_offenders_to_avoid
    avoided: list[tuple[str, int]] = []
    kept: list[tuple[str, int]] = []
    for node, count in offenders:
        if node in lost:
            continue
        if len(avoided) < avoid and free:
            replaced[node] = free.pop(0)
            avoided.append((node, count))
        else:
            kept.append((node, count))
    counts = dict(avoided)
    swaps = [
        f"{old} -> {new}"
        + (
            f" (repeat offender, {_plural(counts[old], 'fault')}; "
            f"maxNumRepeatOffendersToAvoid={avoid})"
            if old in counts
            else ""
        )
        for old, new in replaced.items()
    ]
    if swaps:
        notes.append("replacing " + ", ".join(swaps))
    if fresh:
        notes.append(f"no spare left: {', '.join(fresh)} restarts as a fresh node with the same id")
    if kept:
        if len(avoided) >= avoid:
            why_kept = f"maxNumRepeatOffendersToAvoid={avoid} reached"
        else:
            why_kept = "no spare left"
        notes.append(f"{_offender_names(kept, _window_text(config))} kept: {why_kept}")
    notes.append(budgets)
    return Restart(
        RestartScope.JOB,
        tuple(replaced.get(node, node) for node in nodes),
        replaced,
        f"{why} ({'; '.join(notes)})",
    )


def _kept_note(
    culprits: Sequence[tuple[str, int]], config: PolicyConfig, spares: bool, full_done: int
) -> str:
    """Why offenders that faulted in this attempt stay for a process-level restart."""
    if config.max_num_repeat_offenders_to_avoid == 0:
        why = "maxNumRepeatOffendersToAvoid=0"
    elif not spares:
        why = "no spare left"
    else:
        why = (
            f"full job restart budget exhausted (maxFullJobRestarts="
            f"{config.max_full_job_restarts}, full job restarts={full_done})"
        )
    return f"{_offender_names(culprits, _window_text(config))} kept: {why}"


def _lost_nodes(faults: Sequence[Fault], nodes: Sequence[str]) -> list[str]:
    """Nodes of this attempt with a fault that makes them unusable, in node-rank order."""
    hit = {f.node for f in faults if f.type in NODE_FAULTS}
    return [node for node in nodes if node in hit]


def _offenders(
    now: float,
    node_fault_times: Mapping[str, Sequence[float]],
    nodes: Sequence[str],
    faulting: set[str],
    config: PolicyConfig,
) -> list[tuple[str, int]]:
    """(node, fault count in the window) of every offender, worst first.

    Worst: faulted in this attempt, then most faults in the window, then lowest node rank.
    """
    ranked = []
    for index, node in enumerate(nodes):
        times = {t for t in node_fault_times.get(node, ()) if _in_window(t, now, config)}
        if len(times) >= config.repeat_offender_faults:
            ranked.append((node not in faulting, -len(times), index, node))
    return [(node, -negative) for _, negative, _, node in sorted(ranked)]


def _recent_process_restarts(
    now: float, history: Sequence[RestartRecord], config: PolicyConfig
) -> int:
    """Process-level restarts in the window, after the most recent full job restart."""
    since = list(history)
    for index in range(len(history) - 1, -1, -1):
        if history[index].scope is RestartScope.JOB:
            since = list(history[index + 1 :])
            break
    return sum(
        1 for r in since if r.scope is RestartScope.PROCESS and _in_window(r.time, now, config)
    )


def _in_window(time: float, now: float, config: PolicyConfig) -> bool:
    period = config.eval_period_seconds
    return period is None or time >= now - period


def _window_text(config: PolicyConfig) -> str:
    period = config.eval_period_seconds
    if period is None:
        return "in this job (evalPeriodSeconds unset)"
    return f"within evalPeriodSeconds={period:g}"


def _check_inputs(faults: Sequence[Fault], nodes: Sequence[str], spares: Sequence[str]) -> None:
    if not faults:
        raise ValueError("faults: a restart decision needs at least one fault")
    if not nodes:
        raise ValueError("nodes: a restart decision needs the attempt's nodes")
    for name, ids in (("nodes", nodes), ("spares", spares)):
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}: duplicate node ids in {list(ids)}")
    both = sorted(set(nodes) & set(spares))
    if both:
        raise ValueError(f"spares: {', '.join(both)} already among the attempt's nodes")


def _at_least(name: str, value: int | None, low: int) -> None:
    if value is not None and (isinstance(value, bool) or value < low):
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")


def _describe(fault: Fault) -> str:
    where = [f"node {fault.node}"] if fault.node else []
    where += [f"rank {fault.rank}"] if fault.rank is not None else []
    return f"{fault.type}" + (f" on {', '.join(where)}" if where else "")


def _offender_names(offenders: Sequence[tuple[str, int]], window: str) -> str:
    """E.g. "repeat offender node-1 (2 faults) within evalPeriodSeconds=1800"."""
    noun = "repeat offender" if len(offenders) == 1 else "repeat offenders"
    named = ", ".join(f"{node} ({_plural(count, 'fault')})" for node, count in offenders)
    return f"{noun} {named} {window}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
