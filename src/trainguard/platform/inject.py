"""Fault injection for rehearsals and tests: ``trainguard run ... --inject SPEC``.

A SPEC names a fault, its target and its trigger::

    kill:rank=R@step=S       SIGKILL global rank R's worker
    hang:rank=R@step=S       SIGSTOP it (it stays stopped until the injector closes)
    node-kill:node=N@step=S  SIGKILL node rank N's agent and every worker's process group
    slow:rank=R@step=S       throttle the worker: SIGSTOP/SIGCONT in a duty cycle
    xid:node=N[,code=C]@...  a kernel-log XID line (default 79) for node N's health monitor
    disk-full:node=N@...     node N's free-space monitors report its disks full
    health:node=N,check=C    node N fails its on-start health check C (no trigger: at launch)
    preempt:node=N@...       node N is taken away (elastic: capacity - 1, then it is killed
                             after gracefulShutdownTimeoutInSeconds unless given up)
    capacity:+K@...          K more nodes become available (elastic: capacity + K)
    partition:node=N@...[,for=T]  node N's host is cut off the network (for T seconds,
                             at most and by default an hour; a job on several hosts:
                             its host daemon takes its own interface down, as root,
                             if started with TRAINGUARD_ALLOW_PARTITION=1; never node 0)
    ...@Ts                   T seconds (float) after the job's first completed step

``xid`` and ``disk-full`` go through the node agent's rehearsal hooks (files in its
``--health-hooks`` directory; trainguard never writes to the real kernel log), and
``health`` through its ``--health-fail`` flag.

The :class:`Injector` decides (which injection is due, at which pid) and an
:class:`Actuator` acts (signals, the throttle thread), so decisions can be
tested without signals. With ``delegate_steps``, step-triggered kill, hang and
slow injections are left to the node agents instead (:meth:`Injector.delegated`,
:mod:`trainguard.agent.inject`): an agent reads every line of its ranks and hits
the named step within one, where the controller sees progress only when it
polls; the platform hands them out and :meth:`Injector.confirm` records what an
agent reports it fired. The controller still fires one whose rank's node shows no
progress of its own (``Targets.agents_see``), from the job's progress.
Each injection fires at most once per job: once it has hit a live process it is
never fired again, even when a restart passes the same step; until then (target
not known yet, or already gone) it waits.

Assumptions: the pids in :class:`Targets` are current (the runner saw them on
its last status poll); agents and workers each lead their own process group;
Linux ``/proc`` is used to tell a process from a later one reusing its pid.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Protocol

from trainguard.health.suite import CHECK_NAMES
from trainguard.platform.actuate import SignalActuator, write_hook
from trainguard.wire.requests import StepInjection
from trainguard.wire.status import InjectedFault

KINDS = (
    "kill", "hang", "node-kill", "slow", "xid", "disk-full", "health", "preempt", "capacity",
    "partition",
)  # fmt: skip
_TARGET_KEY = {
    "kill": "rank",
    "hang": "rank",
    "slow": "rank",
    "node-kill": "node",
    "xid": "node",
    "disk-full": "node",
    "health": "node",
    "preempt": "node",
    "capacity": "count",
    "partition": "node",
}
_ACTION = {
    "kill": "SIGKILL",
    "hang": "SIGSTOP",
    "slow": "SIGSTOP/SIGCONT throttle",
    "node-kill": "SIGKILL agent and workers",
    "xid": "an XID line in its kernel-log hook",
    "disk-full": "its space monitors report full",
    "preempt": "taken away",
    "capacity": "capacity given",
    "partition": "its host cut off the network",
}
DEFAULT_XID = 79  # GPU has fallen off the bus

INJECT_HELP = (
    "inject a fault (repeatable): kill:rank=R@step=S (SIGKILL), hang:rank=R@step=S (SIGSTOP), "
    "node-kill:node=N@step=S (the node's agent and workers), slow:rank=R@step=S (throttled), "
    "xid:node=N[,code=C]@step=S (an XID in its kernel-log hook), disk-full:node=N@step=S, "
    "health:node=N,check=NAME (fails that on-start check), "
    "partition:node=N@step=S[,for=T] (several hosts: its host cut off, for T seconds); "
    "@Ts (seconds after the first completed step) in place of @step=S"
)

_INT = re.compile(r"\d+")
_SECONDS = re.compile(r"(\d+(?:\.\d*)?|\.\d+)s")


@dataclass(frozen=True)
class Injection:
    """One parsed ``--inject`` SPEC; exactly one of rank/node and one of at_step/at_seconds."""

    kind: str  # one of KINDS
    rank: int | None
    node: int | None
    at_step: int | None
    at_seconds: float | None
    text: str  # the SPEC as given
    code: int | None = None  # xid: the XID code
    check: str | None = None  # health: the on-start check to fail
    duration: float | None = None  # partition: how long the host stays cut off (None: for good)

    @property
    def target(self) -> str:
        if self.kind == "capacity":
            return f"+{self.code} nodes"
        return f"rank {self.rank}" if self.rank is not None else f"node {self.node}"

    @property
    def trigger(self) -> str:
        if self.at_step is not None:
            return f"step {self.at_step}"
        return f"{self.at_seconds:g} s after the first step"


def parse_injection(text: str) -> Injection:
    """Parse ``KIND:KEY=N@step=S`` or ``KIND:KEY=N@Ts``; ValueError naming the SPEC."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"--inject {text!r}: {problem}")

    spec = text.strip()
    kind, colon, rest = spec.partition(":")
    if not colon:
        raise bad("expected KIND:TARGET@TRIGGER, e.g. kill:rank=1@step=10")
    if kind not in KINDS:
        raise bad(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    key = _TARGET_KEY[kind]
    if kind == "health":
        return _health_injection(text, rest, bad)
    code: int | None = None
    duration: float | None = None
    if kind == "capacity":
        rest, code = _capacity(rest, bad)
    if kind == "partition":
        rest, duration = _partition_for(rest, bad)
    if rest.count("@") != 1:
        raise bad(f"expected one '@' between target and trigger, e.g. {kind}:{key}=1@step=10")
    target, trigger = rest.split("@")
    if kind != "capacity":  # capacity's target is already count=K
        target, code = _xid_code(kind, target, bad)
    name, equals, value = target.partition("=")
    if not equals or name != key:
        raise bad(f"{kind} takes a target {key}=N, got {target!r}")
    if not _INT.fullmatch(value):
        raise bad(f"{key} must be a non-negative integer, got {value!r}")
    number = int(value)

    at_step: int | None = None
    at_seconds: float | None = None
    if trigger.startswith("step="):
        step = trigger.removeprefix("step=")
        if not _INT.fullmatch(step):
            raise bad(f"step must be a non-negative integer, got {step!r}")
        at_step = int(step)
    elif _SECONDS.fullmatch(trigger):
        at_seconds = float(trigger[:-1])
        if not math.isfinite(at_seconds):
            raise bad(f"seconds must be finite, got {trigger!r}")
    else:
        raise bad(
            f"trigger must be step=S or Ts (seconds after the first step, e.g. 2.5s), "
            f"got {trigger!r}"
        )
    return Injection(
        kind=kind,
        rank=number if key == "rank" else None,
        node=number if key == "node" else None,
        at_step=at_step,
        at_seconds=at_seconds,
        text=text,
        code=code,
        duration=duration,
    )


def _partition_for(rest: str, bad: Callable[[str], ValueError]) -> tuple[str, float | None]:
    """``node=N@TRIGGER[,for=T]`` of a partition: the rest without ``,for=T``, and T."""
    head, comma, extra = rest.rpartition(",for=")
    if not comma:
        return rest, None
    try:
        seconds = float(extra)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise bad(f"for=T takes a number of seconds > 0, got {extra!r}")
    return head, seconds


def _capacity(rest: str, bad: Callable[[str], ValueError]) -> tuple[str, int]:
    """``+K@TRIGGER`` of a capacity injection: ``@TRIGGER`` and K."""
    amount, at, trigger = rest.partition("@")
    if not amount.startswith("+") or not _INT.fullmatch(amount[1:]) or int(amount[1:]) < 1:
        raise bad("expected capacity:+K@TRIGGER with K >= 1, e.g. capacity:+2@10s")
    return f"count={amount[1:]}{at}{trigger}", int(amount[1:])


def _xid_code(kind: str, target: str, bad: Callable[[str], ValueError]) -> tuple[str, int | None]:
    """``node=N[,code=C]`` of an xid injection: the target and the code (default 79)."""
    if kind != "xid":
        return target, None
    node, comma, extra = target.partition(",")
    if not comma:
        return node, DEFAULT_XID
    name, _, value = extra.partition("=")
    if name != "code" or not _INT.fullmatch(value) or not 0 < int(value) < 1000:
        raise bad(f"xid takes node=N[,code=C] with C an XID code (1..999), got {target!r}")
    return node, int(value)


def _health_injection(text: str, rest: str, bad: Callable[[str], ValueError]) -> Injection:
    """``health:node=N,check=NAME``: node N fails that on-start check (at launch)."""
    node, comma, check = rest.partition(",")
    name, _, value = node.partition("=")
    if "@" in rest or not comma or name != "node" or not _INT.fullmatch(value):
        raise bad("expected health:node=N,check=NAME (no trigger: the check runs at launch)")
    key, _, check_name = check.partition("=")
    if key != "check" or check_name not in CHECK_NAMES:
        raise bad(f"check must be one of {', '.join(CHECK_NAMES)}, got {check!r}")
    return Injection("health", None, int(value), None, None, text, check=check_name)


@dataclass(frozen=True)
class Targets:
    """Where things are right now, as the runner last saw them."""

    rank_pids: Mapping[int, int]  # global rank -> worker pid (current attempt)
    node_pids: Mapping[int, tuple[int, tuple[int, ...]]]  # node rank -> (agent pid, worker pids)
    # Ranks whose node's agent sees progress lines: it fires their delegated injections.
    agents_see: frozenset[int] = frozenset()
    # node rank -> its agent's rehearsal hook directory (xid, disk-full).
    node_hooks: Mapping[int, Path] = field(default_factory=dict)
    # The node ranks the attempt runs, wherever their processes are (another host's too).
    nodes: frozenset[int] = frozenset()

    def node_of(self, pid: int) -> int | None:
        """The node rank whose workers include ``pid``, if known."""
        for node, (_, workers) in self.node_pids.items():
            if pid in workers:
                return node
        return None


@dataclass(frozen=True)
class Fired:
    """An injection that hit: when, at which step, whom, and the pids signalled."""

    injection: Injection
    time: float
    step: int | None
    rank: int | None
    node: int | None
    pids: tuple[int, ...]

    @property
    def message(self) -> str:
        """One line for the job's events, marked as injected."""
        who = self.injection.target
        if self.rank is not None and self.node is not None:
            who += f" on node {self.node}"
        at = f"step {self.step}" if self.step is not None else "no step yet"
        pids = ", ".join(str(p) for p in self.pids)
        action = _ACTION[self.injection.kind] + (f"; pid {pids}" if pids else "")
        return (
            f"injected {self.injection.kind} of {who} ({action}) at {at} "
            f"[--inject {self.injection.text}]"
        )


class Actuator(Protocol):
    """Turns an injection into signals. Each method returns False when the target is gone."""

    def kill(self, pid: int) -> bool:
        """SIGKILL the process."""
        ...

    def stop(self, pid: int) -> bool:
        """SIGSTOP the process and remember it, so close() can resume it."""
        ...

    def kill_node(self, agent_pid: int, worker_pids: Sequence[int]) -> bool:
        """SIGKILL the agent's and every worker's process group; False when the agent is gone."""
        ...

    def throttle(self, pid: int) -> bool:
        """Start alternating SIGSTOP/SIGCONT on the process in the background."""
        ...

    def close(self) -> None:
        """End every throttle and SIGCONT every process stopped here that still lives."""
        ...


def signal_rank(actuator: Actuator, kind: str, pid: int) -> bool:
    """Carry out a kill, hang or slow injection on a rank's process; False when it is gone."""
    act = {"kill": actuator.kill, "hang": actuator.stop, "slow": actuator.throttle}[kind]
    return act(pid)


class Injector:
    """Fires each due injection once at the process the runner last saw; see the module doc."""

    def __init__(
        self,
        injections: Sequence[Injection],
        world_size: int,
        nnodes: int,
        actuator: Actuator | None = None,
        *,
        delegate_steps: bool = False,
    ) -> None:
        if world_size < 1 or nnodes < 1:
            raise ValueError(f"world size and nnodes must be >= 1, got {world_size}, {nnodes}")
        for injection in injections:
            if injection.rank is not None and not 0 <= injection.rank < world_size:
                raise ValueError(
                    f"--inject {injection.text!r}: rank {injection.rank} is out of range; "
                    f"the world size is {world_size} (ranks 0..{world_size - 1})"
                )
            if injection.node is not None and not 0 <= injection.node < nnodes:
                raise ValueError(
                    f"--inject {injection.text!r}: node {injection.node} is out of range; "
                    f"the job has {nnodes} nodes (nodes 0..{nnodes - 1})"
                )
        # id -> injection, in the order given; health injections act at launch instead.
        self._pending = {k: i for k, i in enumerate(injections) if i.kind != "health"}
        self.health_failures: dict[int, tuple[str, ...]] = {}  # node rank -> checks
        for injection in injections:
            if injection.kind == "health" and injection.node is not None and injection.check:
                checks = self.health_failures.get(injection.node, ())
                self.health_failures[injection.node] = (*checks, injection.check)
        self._delegate_steps = delegate_steps
        self._fired: list[Fired] = []
        self._actuator: Actuator = actuator if actuator is not None else SignalActuator()
        self._closed = False

    @property
    def pending(self) -> list[Injection]:
        """Injections that have not fired yet, in the order given."""
        return list(self._pending.values())

    def delegated(self) -> tuple[StepInjection, ...]:
        """The pending injections the node agents carry out (with ``delegate_steps``)."""
        return tuple(
            StepInjection(id=k, kind=i.kind, rank=i.rank, at_step=i.at_step)  # type: ignore[arg-type]
            for k, i in self._pending.items()
            if self._agents_fire(i) and i.rank is not None and i.at_step is not None
        )

    def confirm(self, fault: InjectedFault, node: int | None) -> Fired | None:
        """An agent fired delegated injection ``fault.id``: record it (once)."""
        if self._closed:
            return None
        injection = self._pending.pop(fault.id, None)
        if injection is None:
            return None
        hit = Fired(injection, fault.time, fault.step, fault.rank, node, (fault.pid,))
        self._fired.append(hit)
        return hit

    @property
    def fired(self) -> list[Fired]:
        """Every injection fired so far, in firing order."""
        return list(self._fired)

    def poll(
        self, now: float, step: int | None, first_step_at: float | None, targets: Targets
    ) -> list[Fired]:
        """Fire every due injection whose target is known and alive; return what fired.

        ``now`` and ``first_step_at`` are on the same clock; ``step`` is the job's
        latest completed step (None before the first). Nothing fires after close().
        """
        if self._closed:
            return []
        fired: list[Fired] = []
        for k, injection in list(self._pending.items()):
            if self._agents_fire(injection) and injection.rank in targets.agents_see:
                continue
            if not _due(injection, now, step, first_step_at):
                continue
            hit = self._fire(injection, now, step, targets)
            if hit is not None:
                del self._pending[k]
                fired.append(hit)
        self._fired += fired
        return fired

    def close(self) -> None:
        """Stop every throttle and SIGCONT what was stopped; idempotent."""
        if not self._closed:
            self._closed = True
            self._actuator.close()

    def __enter__(self) -> Injector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _agents_fire(self, injection: Injection) -> bool:
        return (
            self._delegate_steps
            and injection.at_step is not None
            and injection.kind in ("kill", "hang", "slow")
        )

    def _fire(
        self, injection: Injection, now: float, step: int | None, targets: Targets
    ) -> Fired | None:
        if injection.kind == "node-kill":
            assert injection.node is not None
            entry = targets.node_pids.get(injection.node)
            if entry is None:
                return None
            agent_pid, worker_pids = entry
            if not self._actuator.kill_node(agent_pid, worker_pids):
                return None
            return Fired(injection, now, step, None, injection.node, (agent_pid, *worker_pids))
        if injection.kind == "capacity":  # the platform gives the job more nodes
            return Fired(injection, now, step, None, None, ())
        if injection.kind in ("preempt", "partition"):  # the platform acts on the node
            assert injection.node is not None
            if injection.node not in targets.node_pids and injection.node not in targets.nodes:
                return None
            return Fired(injection, now, step, None, injection.node, ())
        if injection.kind in ("xid", "disk-full"):
            assert injection.node is not None
            hooks = targets.node_hooks.get(injection.node)
            if hooks is None or not write_hook(hooks, injection.kind, injection.code):
                return None
            return Fired(injection, now, step, None, injection.node, ())
        assert injection.rank is not None
        pid = targets.rank_pids.get(injection.rank)
        if pid is None:
            return None
        if not signal_rank(self._actuator, injection.kind, pid):
            return None
        return Fired(injection, now, step, injection.rank, targets.node_of(pid), (pid,))


def _due(injection: Injection, now: float, step: int | None, first_step_at: float | None) -> bool:
    if injection.at_step is not None:
        return step is not None and step >= injection.at_step
    assert injection.at_seconds is not None
    return first_step_at is not None and now - first_step_at >= injection.at_seconds
