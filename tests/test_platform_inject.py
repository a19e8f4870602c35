"""Fault injection: SPEC parsing, the injector's decisions, real signals on real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from trainguard.platform.actuate import SignalActuator
from trainguard.platform.inject import Injector, Targets, parse_injection
from trainguard.wire.requests import StepInjection
from trainguard.wire.status import InjectedFault

WAIT_SECONDS = 10.0


# -- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kill:rank=1@step=10", ("kill", 1, None, 10, None)),
        ("hang:rank=0@step=0", ("hang", 0, None, 0, None)),
        ("node-kill:node=1@step=7", ("node-kill", None, 1, 7, None)),
        ("slow:rank=3@step=12", ("slow", 3, None, 12, None)),
        ("kill:rank=2@30s", ("kill", 2, None, None, 30.0)),
        ("node-kill:node=0@2.5s", ("node-kill", None, 0, None, 2.5)),
        ("slow:rank=0@.5s", ("slow", 0, None, None, 0.5)),
        ("hang:rank=1@0s", ("hang", 1, None, None, 0.0)),
        ("  kill:rank=1@step=3 ", ("kill", 1, None, 3, None)),
    ],
)
def test_valid_specs_parse(
    text: str, expected: tuple[str, int | None, int | None, int | None, float | None]
) -> None:
    injection = parse_injection(text)
    got = (injection.kind, injection.rank, injection.node, injection.at_step, injection.at_seconds)
    assert got == expected
    assert injection.text == text


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "expected KIND:TARGET@TRIGGER"),
        ("kill", "expected KIND:TARGET@TRIGGER"),
        ("boom:rank=1@step=1", "unknown kind 'boom'"),
        ("Kill:rank=1@step=1", "unknown kind 'Kill'"),
        ("kill:rank=1", "expected one '@'"),
        ("kill:rank=1@step=1@step=2", "expected one '@'"),
        ("kill:node=1@step=1", "kill takes a target rank=N"),
        ("node-kill:rank=1@step=1", "node-kill takes a target node=N"),
        ("kill:rank@step=1", "kill takes a target rank=N"),
        ("kill:@step=1", "kill takes a target rank=N"),
        ("kill:rank=-1@step=1", "rank must be a non-negative integer, got '-1'"),
        ("kill:rank=x@step=1", "rank must be a non-negative integer, got 'x'"),
        ("kill:rank=@step=1", "rank must be a non-negative integer, got ''"),
        ("node-kill:node=1.0@step=1", "node must be a non-negative integer"),
        ("kill:rank=1@step=", "step must be a non-negative integer, got ''"),
        ("kill:rank=1@step=1.5", "step must be a non-negative integer, got '1.5'"),
        ("kill:rank=1@step=-2", "step must be a non-negative integer"),
        ("kill:rank=1@5", "trigger must be step=S or Ts"),
        ("kill:rank=1@s", "trigger must be step=S or Ts"),
        ("kill:rank=1@-3s", "trigger must be step=S or Ts"),
        ("kill:rank=1@infs", "trigger must be step=S or Ts"),
        ("kill:rank=1@3m", "trigger must be step=S or Ts"),
        ("kill:rank=1@", "trigger must be step=S or Ts"),
    ],
)
def test_malformed_specs_name_the_spec_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_injection(text)
    message = str(caught.value)
    assert f"--inject {text!r}" in message
    assert problem in message


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("kill:rank=4@step=1", "rank 4 is out of range; the world size is 4 (ranks 0..3)"),
        ("slow:rank=9@1s", "rank 9 is out of range"),
        ("node-kill:node=2@step=1", "node 2 is out of range; the job has 2 nodes (nodes 0..1)"),
    ],
)
def test_injector_refuses_targets_outside_the_job(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        Injector([parse_injection(text)], world_size=4, nnodes=2, actuator=Recorder())
    assert f"--inject {text!r}" in str(caught.value)
    assert problem in str(caught.value)


# -- decisions (no signals) ------------------------------------------------------------


class Recorder:
    """An actuator that records calls; ``gone`` pids count as already exited."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.gone: set[int] = set()
        self.closed = 0

    def _record(self, action: str, *pids: int) -> bool:
        if pids[0] in self.gone:
            return False
        self.calls.append((action, pids))
        return True

    def kill(self, pid: int) -> bool:
        return self._record("kill", pid)

    def stop(self, pid: int) -> bool:
        return self._record("stop", pid)

    def kill_node(self, agent_pid: int, worker_pids: Sequence[int]) -> bool:
        return self._record("kill_node", agent_pid, *worker_pids)

    def throttle(self, pid: int) -> bool:
        return self._record("throttle", pid)

    def close(self) -> None:
        self.closed += 1


# 2 nodes x 2 ranks; pids of attempt 0 and of a restarted attempt 1.
ATTEMPT0 = Targets({0: 100, 1: 101, 2: 102, 3: 103}, {0: (10, (100, 101)), 1: (11, (102, 103))})
ATTEMPT1 = Targets({0: 200, 1: 201, 2: 202, 3: 203}, {0: (20, (200, 201)), 1: (21, (202, 203))})
NOBODY = Targets({}, {})


def injector(*specs: str) -> tuple[Injector, Recorder]:
    recorder = Recorder()
    return Injector([parse_injection(s) for s in specs], 4, 2, actuator=recorder), recorder


def test_step_injection_fires_once_at_its_step_and_not_after_a_restart() -> None:
    inj, rec = injector("kill:rank=2@step=5")
    assert inj.poll(100.0, None, None, ATTEMPT0) == []
    assert inj.poll(101.0, 4, 100.5, ATTEMPT0) == []
    fired = inj.poll(102.0, 5, 100.5, ATTEMPT0)
    assert [(f.injection.text, f.time, f.step, f.rank, f.node, f.pids) for f in fired] == [
        ("kill:rank=2@step=5", 102.0, 5, 2, 1, (102,))
    ]
    assert rec.calls == [("kill", (102,))]
    assert inj.pending == []
    assert inj.fired == fired
    # The job restarts and passes step 5 again: nothing more.
    assert inj.poll(110.0, 5, 100.5, ATTEMPT1) == []
    assert inj.poll(111.0, 9, 100.5, ATTEMPT1) == []
    assert rec.calls == [("kill", (102,))]


def test_delegated_step_injections_are_left_to_the_agents_and_confirmed_once() -> None:
    recorder = Recorder()
    specs = ["kill:rank=2@step=5", "slow:rank=1@2s", "node-kill:node=0@step=3"]
    inj = Injector([parse_injection(s) for s in specs], 4, 2, recorder, delegate_steps=True)
    assert inj.delegated() == (StepInjection(id=0, kind="kill", rank=2, at_step=5),)
    # The controller fires the others itself, and the delegated one only where rank 2's
    # node shows no progress of its own (its agent could not see the step).
    seeing = Targets(ATTEMPT0.rank_pids, ATTEMPT0.node_pids, frozenset({2, 3}))
    fired = inj.poll(10.0, 9, 0.0, seeing)
    assert sorted(f.injection.text for f in fired) == sorted(specs[1:])
    assert ("kill", (102,)) not in recorder.calls
    report = InjectedFault(id=0, rank=2, step=5, pid=102, time=9.5)
    hit = inj.confirm(report, node=1)
    assert hit is not None and (hit.step, hit.rank, hit.node, hit.pids) == (5, 2, 1, (102,))
    assert inj.confirm(report, node=1) is None  # reported again by a later status
    assert inj.delegated() == () and inj.pending == []
    blind = Injector([parse_injection(specs[0])], 4, 2, Recorder(), delegate_steps=True)
    [by_controller] = blind.poll(10.0, 9, 0.0, ATTEMPT0)  # no node shows progress
    assert by_controller.pids == (102,) and blind.delegated() == ()


def test_a_step_already_passed_fires_at_once() -> None:
    inj, rec = injector("hang:rank=1@step=3")
    [fired] = inj.poll(1.0, 8, 0.0, ATTEMPT0)
    assert fired.step == 8
    assert rec.calls == [("stop", (101,))]


def test_seconds_count_from_the_first_completed_step() -> None:
    inj, rec = injector("slow:rank=0@2.5s")
    assert inj.poll(1000.0, None, None, ATTEMPT0) == []  # no step yet: the clock has not started
    assert inj.poll(1002.0, 3, 1000.0, ATTEMPT0) == []
    [fired] = inj.poll(1002.5, 4, 1000.0, ATTEMPT0)
    assert (fired.rank, fired.node, fired.pids, fired.step) == (0, 0, (100,), 4)
    assert rec.calls == [("throttle", (100,))]


def test_an_injection_waits_for_its_target_to_be_known() -> None:
    inj, rec = injector("kill:rank=3@step=1", "node-kill:node=1@step=1")
    assert inj.poll(1.0, 2, 0.0, NOBODY) == []
    only_node0 = Targets({0: 100, 1: 101}, {0: (10, (100, 101))})
    assert inj.poll(2.0, 2, 0.0, only_node0) == []
    assert [i.text for i in inj.pending] == ["kill:rank=3@step=1", "node-kill:node=1@step=1"]
    fired = inj.poll(3.0, 2, 0.0, ATTEMPT0)
    assert [f.injection.kind for f in fired] == ["kill", "node-kill"]
    assert rec.calls == [("kill", (103,)), ("kill_node", (11, 102, 103))]
    assert fired[1].pids == (11, 102, 103)
    assert (fired[1].rank, fired[1].node) == (None, 1)


def test_a_target_already_gone_keeps_the_injection_for_the_next_attempt() -> None:
    inj, rec = injector("kill:rank=1@step=2")
    rec.gone.add(101)
    assert inj.poll(1.0, 2, 0.0, ATTEMPT0) == []
    assert [i.text for i in inj.pending] == ["kill:rank=1@step=2"]
    [fired] = inj.poll(2.0, 2, 0.0, ATTEMPT1)
    assert fired.pids == (201,)


def test_each_injection_fires_on_its_own_trigger() -> None:
    inj, rec = injector("kill:rank=0@step=2", "hang:rank=1@step=4", "slow:rank=2@1s")
    assert [f.injection.kind for f in inj.poll(10.0, 2, 9.5, ATTEMPT0)] == ["kill"]
    assert [f.injection.kind for f in inj.poll(10.5, 3, 9.5, ATTEMPT0)] == ["slow"]
    assert [f.injection.kind for f in inj.poll(11.0, 4, 9.5, ATTEMPT0)] == ["hang"]
    assert [action for action, _ in rec.calls] == ["kill", "throttle", "stop"]


def test_fired_message_is_marked_injected() -> None:
    inj, _ = injector("kill:rank=2@step=5")
    [fired] = inj.poll(1.0, 5, 0.0, ATTEMPT0)
    message = fired.message
    assert message.startswith("injected kill of rank 2 on node 1")
    assert "SIGKILL" in message and "102" in message and "step 5" in message
    assert "kill:rank=2@step=5" in message


def test_close_closes_the_actuator_once_and_stops_firing() -> None:
    inj, rec = injector("kill:rank=0@step=1")
    with inj:
        pass
    inj.close()
    assert rec.closed == 1
    assert inj.poll(1.0, 5, 0.0, ATTEMPT0) == []
    assert rec.calls == []
    assert [i.text for i in inj.pending] == ["kill:rank=0@step=1"]


# -- the real actuator on real processes -------------------------------------------------


def proc_state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...) or None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2]


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    return proc_state(pid) in (None, "Z", "X")


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start child processes; every one left is killed and reaped after the test."""
    children: list[subprocess.Popen[str]] = []

    def start(*argv: str, new_session: bool = False) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, text=True, start_new_session=new_session
        )
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


# A process leading its own group with a child in that group; it prints the child's pid.
PARENT_WITH_CHILD = (
    "import subprocess, time; c = subprocess.Popen(['sleep', '60']); "
    "print(c.pid, flush=True); time.sleep(60)"
)


def test_kill_sigkills_the_process(spawn: Callable[..., subprocess.Popen[str]]) -> None:
    child = spawn("sleep", "60")
    actuator = SignalActuator()
    assert actuator.kill(child.pid)
    assert child.wait(WAIT_SECONDS) == -9
    assert not actuator.kill(child.pid)  # gone now: reported, not raised
    actuator.close()


def test_stop_leaves_the_process_stopped_until_close(
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    child = spawn("sleep", "60")
    actuator = SignalActuator()
    assert actuator.stop(child.pid)
    wait_until(lambda: proc_state(child.pid) == "T", "state T")
    time.sleep(0.2)
    assert proc_state(child.pid) == "T"  # nobody resumes it
    actuator.close()
    wait_until(lambda: proc_state(child.pid) == "S", "resumed after close")


def test_node_kill_kills_the_agent_and_worker_process_groups(
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    agent = spawn(sys.executable, "-c", PARENT_WITH_CHILD, new_session=True)
    worker = spawn(sys.executable, "-c", PARENT_WITH_CHILD, new_session=True)
    bystander = spawn("sleep", "60", new_session=True)
    assert agent.stdout is not None and worker.stdout is not None
    agent_child = int(agent.stdout.readline())
    worker_child = int(worker.stdout.readline())

    actuator = SignalActuator()
    assert actuator.kill_node(agent.pid, [worker.pid])
    assert agent.wait(WAIT_SECONDS) == -9
    assert worker.wait(WAIT_SECONDS) == -9
    wait_until(lambda: gone(agent_child) and gone(worker_child), "the groups' children to die")
    assert bystander.poll() is None
    assert not actuator.kill_node(agent.pid, [worker.pid])  # the agent is gone
    actuator.close()


def test_throttle_alternates_and_resumes_on_close(
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    child = spawn("sleep", "60")
    actuator = SignalActuator(slow_run_seconds=0.1, slow_stop_seconds=0.1)
    assert actuator.throttle(child.pid)
    seen: set[str | None] = set()
    deadline = time.monotonic() + WAIT_SECONDS
    running = {"R", "S"}  # a continued `sleep` is briefly R (waking) before it sleeps again
    while not (seen & running and "T" in seen) and time.monotonic() < deadline:
        seen.add(proc_state(child.pid))
        time.sleep(0.005)
    assert seen & running and "T" in seen and seen <= running | {"T"}, seen
    assert actuator.throttled_pids == [child.pid]
    actuator.close()
    assert actuator.throttled_pids == []
    time.sleep(0.3)  # longer than a whole duty cycle: it stays running
    assert proc_state(child.pid) in running


def test_throttle_ends_by_itself_when_the_process_dies(
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    child = spawn("sleep", "60")
    actuator = SignalActuator(slow_run_seconds=0.05, slow_stop_seconds=0.05)
    assert actuator.throttle(child.pid)
    child.kill()  # not reaped yet: a zombie counts as gone
    wait_until(lambda: actuator.throttled_pids == [], "the throttle thread to end")
    actuator.close()
    assert not actuator.throttle(child.pid)


def test_injector_with_the_real_actuator(spawn: Callable[..., subprocess.Popen[str]]) -> None:
    ranks = [spawn("sleep", "60") for _ in range(2)]
    targets = Targets({0: ranks[0].pid, 1: ranks[1].pid}, {})
    specs = ["kill:rank=0@step=2", "hang:rank=1@0.1s"]
    with Injector([parse_injection(s) for s in specs], world_size=2, nnodes=1) as inj:
        assert inj.poll(10.0, 1, 10.0, targets) == []
        fired = inj.poll(10.2, 2, 10.0, targets)
        assert [f.injection.kind for f in fired] == ["kill", "hang"]
        assert ranks[0].wait(WAIT_SECONDS) == -9
        wait_until(lambda: proc_state(ranks[1].pid) == "T", "rank 1 stopped")
    wait_until(lambda: proc_state(ranks[1].pid) == "S", "rank 1 resumed on close")


def test_the_duty_cycle_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slow duty cycle"):
        SignalActuator(slow_run_seconds=0.0)


def test_an_injection_that_never_fires_is_said_and_one_that_cannot_is_refused(
    tmp_path: Path,
) -> None:
    """A step past the job's end: a warning when the job ends (not silence); capacity
    faults on a job that is not elastic: refused before anything starts (exit 2)."""
    import os

    from conftest import REPO

    env = {**os.environ, "TRAINGUARD_STATE_DIR": str(tmp_path)}
    worker = str(REPO / "tests" / "scripts" / "step_worker.py")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "1", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

    late = run("--inject", "kill:rank=0@step=5000", worker, "20")
    assert late.returncode == 0, late.stderr
    assert "warning: --inject kill:rank=0@step=5000 never fired" in late.stderr
    refused = run("--inject", "preempt:node=0@step=5", worker, "20")
    assert refused.returncode == 2
    assert "only an elastic job (spec.elasticPolicy, or --nnodes MIN:MAX)" in refused.stderr
