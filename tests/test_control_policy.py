"""The restart policy as a pure function: every branch, its boundaries, its defaults."""

from collections.abc import Mapping, Sequence

import pytest

from trainguard.control.events import Fault, FaultType
from trainguard.control.policy import (
    DEFAULT_MAX_NUM_REPEAT_OFFENDERS_TO_AVOID,
    DEFAULT_NUM_RESTART_BEFORE_FULL_JOB_RESTART,
    DEFAULT_REPEAT_OFFENDER_FAULTS,
    GiveUp,
    PolicyConfig,
    Restart,
    RestartRecord,
    RestartScope,
    decide_restart,
    fault_cause,
)
from trainguard.spec import RestartPolicy, RunPolicy

NODES = ("node-0", "node-1", "node-2")
NOW = 10_000.0
P, J = RestartScope.PROCESS, RestartScope.JOB


def config(**kw: object) -> PolicyConfig:
    base: dict[str, object] = {
        "job_max_retry_count": 10,
        "num_restart_before_full_job_restart": 3,
        "eval_period_seconds": 1800.0,
        "max_full_job_restarts": 2,
        "max_num_repeat_offenders_to_avoid": 1,
    }
    base.update(kw)
    return PolicyConfig(**base)  # type: ignore[arg-type]


def crash(
    node: str = "node-1", rank: int = 3, message: str = "rank 3 exited with signal SIGKILL"
) -> Fault:
    return Fault(FaultType.WORKER_CRASH, NOW, 1, node=node, rank=rank, message=message)


def lost(node: str = "node-1", type: FaultType = FaultType.NODE_LOST) -> Fault:
    return Fault(type, NOW, 1, node=node, message=f"{node} lost: its agent does not answer")


def history(*items: tuple[float, RestartScope]) -> list[RestartRecord]:
    return [RestartRecord(NOW - age, scope) for age, scope in items]


def decide(
    faults: Sequence[Fault] | None = None,
    past: Sequence[RestartRecord] = (),
    fault_times: Mapping[str, Sequence[float]] | None = None,
    nodes: Sequence[str] = NODES,
    spares: Sequence[str] = (),
    cfg: PolicyConfig | None = None,
) -> Restart | GiveUp:
    faults = [crash()] if faults is None else faults
    if fault_times is None:
        fault_times = {f.node: [f.time] for f in faults if f.node}
    return decide_restart(NOW, faults, past, fault_times, nodes, spares, cfg or config())


def restart(decision: Restart | GiveUp) -> Restart:
    assert isinstance(decision, Restart), decision
    return decision


def give_up(decision: Restart | GiveUp) -> GiveUp:
    assert isinstance(decision, GiveUp), decision
    return decision


# -- retry budget (jobMaxRetryCount) ------------------------------------------


def test_a_crash_restarts_processes_on_the_same_nodes() -> None:
    r = restart(decide())
    assert (r.scope, r.nodes, r.replaced) == (P, NODES, {})
    assert "restart 1 of jobMaxRetryCount=10" in r.reason
    assert "0 earlier process-level restarts within evalPeriodSeconds=1800" in r.reason


def test_budget_exhausted_exactly_at_job_max_retry_count() -> None:
    past = history((900, P), (600, P))
    g = give_up(decide(past=past, cfg=config(job_max_retry_count=2)))
    assert g.reason == (
        "rank 3 exited with signal SIGKILL; retry budget exhausted (jobMaxRetryCount=2, restarts=2)"
    )
    r = restart(decide(past=past, cfg=config(job_max_retry_count=3)))
    assert "restart 3 of jobMaxRetryCount=3" in r.reason


def test_budget_messages_name_what_the_user_set_it_with() -> None:
    """A job from torchrun's flags reads --max-restarts, a spec its field (friction: a
    user of --max-restarts was told about jobMaxRetryCount)."""
    flag = config(job_max_retry_count=1, budget_name="--max-restarts")
    assert "restart 1 of --max-restarts=1" in restart(decide(cfg=flag)).reason
    g = give_up(decide(past=history((60, P)), cfg=flag))
    assert g.reason.endswith("retry budget exhausted (--max-restarts=1, restarts=1)")
    field = "spec.runPolicy.jobMaxRetryCount"
    spec = PolicyConfig.from_spec(None, 0, field)
    assert f"({field}=0, restarts=0)" in give_up(decide(cfg=spec)).reason
    restart_policy = RunPolicy(restart_policy=RestartPolicy(eval_period_seconds=60))
    assert PolicyConfig.from_spec(restart_policy, 2, field).budget_name == field


def test_zero_retries_gives_up_at_once_even_for_a_lost_node() -> None:
    g = give_up(decide([lost()], spares=["spare-0"], cfg=config(job_max_retry_count=0)))
    assert "jobMaxRetryCount=0, restarts=0" in g.reason


def test_restarts_of_both_scopes_count_against_the_budget() -> None:
    past = history((100, J), (50, P))
    assert isinstance(decide(past=past, cfg=config(job_max_retry_count=2)), GiveUp)


# -- unusable nodes -------------------------------------------------------------


@pytest.mark.parametrize("type", [FaultType.NODE_LOST, FaultType.NODE_STOP_TIMEOUT])
def test_an_unusable_node_is_replaced_by_a_spare(type: FaultType) -> None:
    r = restart(decide([lost("node-1", type)], spares=["spare-0", "spare-1"]))
    assert r.scope is J
    assert r.nodes == ("node-0", "spare-0", "node-2")
    assert r.replaced == {"node-1": "spare-0"}
    assert r.reason.startswith(f"full job restart: node-1 unusable after {type} (")
    assert "full job restart 1 of maxFullJobRestarts=2" in r.reason


def test_without_a_spare_an_unusable_node_comes_back_fresh_with_its_id() -> None:
    r = restart(decide([lost("node-1")]))
    assert (r.scope, r.nodes, r.replaced) == (J, NODES, {})
    assert "no spare left: node-1 restarts as a fresh node with the same id" in r.reason


def test_spares_go_to_unusable_nodes_in_node_rank_order() -> None:
    faults = [lost("node-2"), lost("node-0", FaultType.NODE_STOP_TIMEOUT)]
    r = restart(decide(faults, spares=["spare-0"]))
    assert r.replaced == {"node-0": "spare-0"}
    assert r.nodes == ("spare-0", "node-1", "node-2")
    assert "node-0, node-2 unusable after NodeLost, NodeStopTimeout" in r.reason
    assert "node-2 restarts as a fresh node" in r.reason


def test_a_lost_node_outside_the_attempt_is_ignored() -> None:
    r = restart(decide([lost("elsewhere"), crash()]))
    assert r.scope is P


def test_a_fault_without_a_node_is_process_scope() -> None:
    fault = Fault(FaultType.WORKER_CRASH, NOW, 1, message="boom")
    assert restart(decide([fault])).scope is P


def test_a_lost_node_with_no_full_restart_left_gives_up() -> None:
    g = give_up(decide([lost()], cfg=config(max_full_job_restarts=0)))
    assert g.reason == (
        "node-1 lost: its agent does not answer; node-1 unusable after NodeLost: "
        "full job restart budget exhausted (maxFullJobRestarts=0, full job restarts=0)"
    )


# -- escalation (numRestartBeforeFullJobRestart within evalPeriodSeconds) ---------


def test_escalates_when_process_restarts_in_the_window_reach_the_limit() -> None:
    two = history((300, P), (200, P))
    assert restart(decide(past=two)).scope is P
    three = history((300, P), (200, P), (100, P))
    r = restart(decide(past=three))
    assert (r.scope, r.nodes, r.replaced) == (J, NODES, {})
    assert r.reason.startswith(
        "full job restart: 3 process-level restarts within evalPeriodSeconds=1800 reached "
        "numRestartBeforeFullJobRestart=3 ("
    )
    assert "restart 4 of jobMaxRetryCount=10" in r.reason


def test_a_restart_exactly_at_the_window_edge_counts() -> None:
    at_edge = history((1800, P), (200, P), (100, P))
    assert restart(decide(past=at_edge)).scope is J
    outside = history((1800.5, P), (200, P), (100, P))
    r = restart(decide(past=outside))
    assert r.scope is P
    assert "2 earlier process-level restarts within evalPeriodSeconds=1800" in r.reason


def test_without_a_window_every_process_restart_counts() -> None:
    past = history((10**6, P), (10**5, P), (1, P))
    r = restart(decide(past=past, cfg=config(eval_period_seconds=None)))
    assert r.scope is J
    assert "3 process-level restarts in this job (evalPeriodSeconds unset)" in r.reason


def test_a_full_job_restart_starts_the_count_afresh() -> None:
    past = history((500, P), (400, P), (300, P), (200, J), (100, P))
    r = restart(decide(past=past))
    assert r.scope is P
    assert "1 earlier process-level restart within" in r.reason


def test_zero_before_full_restart_makes_every_restart_a_full_one() -> None:
    r = restart(decide(cfg=config(num_restart_before_full_job_restart=0)))
    assert r.scope is J


def test_unset_count_never_escalates() -> None:
    past = history(*[(10.0 * i, P) for i in range(1, 9)])
    r = restart(decide(past=past, cfg=config(num_restart_before_full_job_restart=None)))
    assert r.scope is P
    assert "numRestartBeforeFullJobRestart" not in r.reason


# -- full job restart budget (maxFullJobRestarts) -----------------------------------


def test_escalation_with_no_full_restart_left_gives_up() -> None:
    past = history((3000, J), (300, P), (200, P), (100, P))
    g = give_up(decide(past=past, cfg=config(max_full_job_restarts=1)))
    assert g.reason == (
        "rank 3 exited with signal SIGKILL; 3 process-level restarts within "
        "evalPeriodSeconds=1800 reached numRestartBeforeFullJobRestart=3: full job restart "
        "budget exhausted (maxFullJobRestarts=1, full job restarts=1)"
    )


def test_the_last_allowed_full_restart_is_granted() -> None:
    past = history((3000, J), (300, P), (200, P), (100, P))
    r = restart(decide(past=past, cfg=config(max_full_job_restarts=2)))
    assert r.scope is J
    assert "full job restart 2 of maxFullJobRestarts=2" in r.reason


def test_full_restarts_count_over_the_whole_job_not_the_window() -> None:
    past = history((10**6, J), (300, P), (200, P), (100, P))
    assert isinstance(decide(past=past, cfg=config(max_full_job_restarts=1)), GiveUp)


def test_unset_full_restart_limit_is_bounded_by_the_retry_budget_only() -> None:
    past = history(*[(10.0 * i, J) for i in range(9, 0, -1)])
    r = restart(decide([lost()], past=past, cfg=config(max_full_job_restarts=None)))
    assert "full job restart 10 (maxFullJobRestarts unset)" in r.reason
    assert "restart 10 of jobMaxRetryCount=10" in r.reason


# -- repeat offenders (maxNumRepeatOffendersToAvoid) --------------------------------


def test_offenders_are_swapped_for_spares_on_a_full_restart_worst_first() -> None:
    times = {"node-0": [NOW - 50, NOW - 10], "node-2": [NOW - 60, NOW - 40, NOW - 20]}
    past = history((300, P), (200, P), (100, P))
    r = restart(decide(past=past, fault_times=times, spares=["spare-0", "spare-1"]))
    assert r.scope is J
    assert r.replaced == {"node-2": "spare-0"}
    assert r.nodes == ("node-0", "node-1", "spare-0")
    assert (
        "replacing node-2 -> spare-0 (repeat offender, 3 faults; "
        "maxNumRepeatOffendersToAvoid=1)" in r.reason
    )
    assert (
        "repeat offender node-0 (2 faults) within evalPeriodSeconds=1800 kept: "
        "maxNumRepeatOffendersToAvoid=1 reached" in r.reason
    )


def test_offenders_tied_on_faults_go_in_node_rank_order() -> None:
    times = {"node-2": [NOW - 20, NOW - 10], "node-1": [NOW - 30, NOW - 5]}
    r = restart(
        decide(
            [lost("node-0")],
            fault_times=times,
            spares=["spare-0", "spare-1", "spare-2"],
            cfg=config(max_num_repeat_offenders_to_avoid=1),
        )
    )
    assert r.replaced == {"node-0": "spare-0", "node-1": "spare-1"}


def test_offenders_stay_when_spares_run_out_and_the_reason_says_so() -> None:
    times = {"node-0": [NOW - 20, NOW - 10], "node-2": [NOW - 30, NOW - 5]}
    r = restart(
        decide(
            [lost("node-1")],
            fault_times=times,
            spares=["spare-0", "spare-1"],
            cfg=config(max_num_repeat_offenders_to_avoid=5),
        )
    )
    assert r.replaced == {"node-1": "spare-0", "node-0": "spare-1"}
    assert r.nodes == ("spare-1", "spare-0", "node-2")
    assert (
        "repeat offender node-2 (2 faults) within evalPeriodSeconds=1800 kept: no spare left"
        in (r.reason)
    )


def test_a_lost_offender_takes_one_spare_and_does_not_use_the_offender_quota() -> None:
    times = {"node-1": [NOW - 20, NOW], "node-2": [NOW - 30, NOW - 5]}
    r = restart(decide([lost("node-1")], fault_times=times, spares=["spare-0", "spare-1"]))
    assert r.replaced == {"node-1": "spare-0", "node-2": "spare-1"}


def test_a_fault_exactly_at_the_window_edge_makes_an_offender() -> None:
    past = history((300, P), (200, P), (100, P))
    inside = {"node-0": [NOW - 1800, NOW - 10]}
    assert restart(decide(past=past, fault_times=inside, spares=["s"])).replaced == {"node-0": "s"}
    outside = {"node-0": [NOW - 1800.5, NOW - 10]}
    assert restart(decide(past=past, fault_times=outside, spares=["s"])).replaced == {}


def test_faults_at_the_same_instant_are_one_incident() -> None:
    times = {"node-1": [NOW, NOW]}  # two ranks of node-1 died together
    assert restart(decide(fault_times=times, spares=["spare-0"])).scope is P


def test_offender_threshold_is_configurable() -> None:
    times = {"node-1": [NOW - 20, NOW]}
    r = restart(decide(fault_times=times, spares=["s"], cfg=config(repeat_offender_faults=3)))
    assert r.scope is P


# -- an offender alone: a full restart when it can be avoided -------------------------


def test_a_faulting_offender_forces_a_full_restart_when_a_spare_is_left() -> None:
    times = {"node-1": [NOW - 600, NOW]}
    r = restart(decide(fault_times=times, spares=["spare-0"]))
    assert (r.scope, r.replaced) == (J, {"node-1": "spare-0"})
    assert r.nodes == ("node-0", "spare-0", "node-2")
    assert r.reason == (
        "full job restart: repeat offender node-1 (2 faults) within evalPeriodSeconds=1800 "
        "faulted again, 1 spare left to avoid it (replacing node-1 -> spare-0 (repeat offender, "
        "2 faults; maxNumRepeatOffendersToAvoid=1); full job restart 1 of maxFullJobRestarts=2; "
        "restart 1 of jobMaxRetryCount=10)"
    )


def test_a_faulting_offender_without_a_spare_is_kept_on_a_process_restart() -> None:
    times = {"node-1": [NOW - 600, NOW]}
    r = restart(decide(fault_times=times))
    assert (r.scope, r.replaced) == (P, {})
    assert (
        "repeat offender node-1 (2 faults) within evalPeriodSeconds=1800 kept: no spare left"
        in (r.reason)
    )


def test_a_faulting_offender_is_kept_when_avoidance_is_off() -> None:
    times = {"node-1": [NOW - 600, NOW]}
    cfg = config(max_num_repeat_offenders_to_avoid=0)
    r = restart(decide(fault_times=times, spares=["spare-0"], cfg=cfg))
    assert r.scope is P
    assert "kept: maxNumRepeatOffendersToAvoid=0" in r.reason


def test_a_faulting_offender_with_no_full_restart_left_gets_a_process_restart() -> None:
    times = {"node-1": [NOW - 600, NOW]}
    past = history((1000, J))
    cfg = config(max_full_job_restarts=1)
    r = restart(decide(past=past, fault_times=times, spares=["spare-0"], cfg=cfg))
    assert r.scope is P
    assert (
        "kept: full job restart budget exhausted (maxFullJobRestarts=1, full job restarts=1)"
        in r.reason
    )


def test_the_offender_that_faulted_now_is_avoided_before_worse_older_ones() -> None:
    times = {"node-0": [NOW - 900, NOW - 600, NOW - 300], "node-1": [NOW - 600, NOW]}
    r = restart(decide(fault_times=times, spares=["spare-0"]))
    assert r.replaced == {"node-1": "spare-0"}
    assert "repeat offender node-0 (3 faults) within evalPeriodSeconds=1800 kept: " in r.reason


def test_an_offender_that_did_not_fault_now_does_not_force_a_full_restart() -> None:
    times = {"node-0": [NOW - 600, NOW - 300], "node-1": [NOW]}
    r = restart(decide(fault_times=times, spares=["spare-0"]))
    assert r.scope is P
    assert "offender" not in r.reason


# -- determinism and inputs ---------------------------------------------------------


def test_same_inputs_same_decision_whatever_the_mapping_order() -> None:
    past = history((300, P), (200, P), (100, P))
    a = {"node-2": [NOW - 20, NOW - 10], "node-0": [NOW - 30, NOW - 5]}
    b = dict(reversed(list(a.items())))
    first = decide(past=past, fault_times=a, spares=["spare-0"])
    assert first == decide(past=past, fault_times=b, spares=["spare-0"])
    assert first == decide(past=past, fault_times=a, spares=["spare-0"])
    assert restart(first).replaced == {"node-0": "spare-0"}


def test_spares_are_taken_in_the_order_given() -> None:
    r = restart(decide([lost("node-0")], spares=["spare-9", "spare-1"]))
    assert r.replaced == {"node-0": "spare-9"}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"faults": []}, "faults: "),
        ({"nodes": []}, "nodes: "),
        ({"nodes": ["a", "a"]}, "nodes: duplicate"),
        ({"spares": ["s", "s"]}, "spares: duplicate"),
        ({"spares": ["node-0"]}, "spares: node-0 already among"),
    ],
)
def test_bad_inputs_name_the_argument(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decide(**kw)  # type: ignore[arg-type]


def test_fault_cause_summarises() -> None:
    assert fault_cause([crash(), crash("node-2")]) == (
        "rank 3 exited with signal SIGKILL (+1 more fault)"
    )
    bare = Fault(FaultType.NODE_LOST, NOW, 0, node="node-1", rank=2)
    assert fault_cause([bare]) == "NodeLost on node node-1, rank 2"
    assert fault_cause([]) == "no fault"


def test_scope_names_follow_hyperpod() -> None:
    # HyperPod's restartType has PLR and JLR only: an in-process restart keeps the pods.
    assert (RestartScope.IN_PROCESS.hyperpod, P.hyperpod, J.hyperpod) == ("PLR", "PLR", "JLR")
    assert (str(P), str(J)) == ("process", "job")


# -- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"job_max_retry_count": -1}, "jobMaxRetryCount"),
        ({"num_restart_before_full_job_restart": -1}, "numRestartBeforeFullJobRestart"),
        ({"max_full_job_restarts": -2}, "maxFullJobRestarts"),
        ({"max_num_repeat_offenders_to_avoid": -1}, "maxNumRepeatOffendersToAvoid"),
        ({"repeat_offender_faults": 0}, "repeat_offender_faults"),
        ({"eval_period_seconds": 0.0}, "evalPeriodSeconds"),
        ({"eval_period_seconds": float("nan")}, "evalPeriodSeconds"),
    ],
)
def test_bad_config_names_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        config(**kw)


def test_from_spec_without_a_run_policy_only_bounds_retries() -> None:
    for run_policy in (None, RunPolicy()):
        assert PolicyConfig.from_spec(run_policy, 4) == PolicyConfig(
            job_max_retry_count=4,
            num_restart_before_full_job_restart=None,
            eval_period_seconds=None,
            max_full_job_restarts=None,
            max_num_repeat_offenders_to_avoid=0,
            repeat_offender_faults=2,
        )


def test_from_spec_reads_every_restart_policy_field() -> None:
    policy = RunPolicy(
        job_max_retry_count=50,
        restart_policy=RestartPolicy(
            eval_period_seconds=21600,
            num_restart_before_full_job_restart=3,
            max_full_job_restarts=1,
            max_num_repeat_offenders_to_avoid=2,
        ),
    )
    assert PolicyConfig.from_spec(policy, 7) == config(
        job_max_retry_count=7,  # the resolved value wins over the spec field
        eval_period_seconds=21600.0,
        max_full_job_restarts=1,
        max_num_repeat_offenders_to_avoid=2,
    )


def test_from_spec_defaults_inside_a_restart_policy() -> None:
    policy = RunPolicy(restart_policy=RestartPolicy(eval_period_seconds=60))
    cfg = PolicyConfig.from_spec(policy, 2)
    assert cfg.eval_period_seconds == 60
    assert cfg.num_restart_before_full_job_restart == DEFAULT_NUM_RESTART_BEFORE_FULL_JOB_RESTART
    assert cfg.max_full_job_restarts is None
    assert cfg.max_num_repeat_offenders_to_avoid == DEFAULT_MAX_NUM_REPEAT_OFFENDERS_TO_AVOID
    assert cfg.repeat_offender_faults == DEFAULT_REPEAT_OFFENDER_FAULTS


def test_from_spec_refuses_a_negative_retry_count() -> None:
    with pytest.raises(ValueError, match="jobMaxRetryCount: must be an integer >= 0"):
        PolicyConfig.from_spec(None, -1)
