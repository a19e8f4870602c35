"""A rank that does not exit: every other rank of the attempt exited 0, and it still runs.

Seen with plain DDP scripts: a deadlock in torch when a process group is freed at the end
(:mod:`trainguard.agent.script_end`) leaves a rank whose work is done running forever,
and the job in Running with nothing said. The rule, decided here from the agents'
reports (pure, like the rest of the package):

- **lingering**: of the attempt's ranks, at least one exited 0, at least one still
  runs, and every one that does not run exited 0 (a failure is a crash, found as such);
- **the bound**: ``exit_hang_timeout`` (``exitHangTimeoutSeconds``, default
  :data:`DEFAULT_TIMEOUT`), or :data:`STEP_FACTOR` times the attempt's mean seconds per
  step when that is longer, counted from when the last of the others was seen to exit
  (another exit starts it again);
- **hung**: past the bound and idle over it, its CPU time (the agent reads it from
  ``/proc``) having grown by less than :data:`IDLE_CPU_FRACTION` of the time. A rank
  that still computes (a final save, an evaluation only rank 0 runs) is left alone and
  said to linger once per bound (a ``Lingering`` event); where no CPU time is reported,
  the bound alone decides;
- **its work was done** unless it reported steps (progress lines, heartbeats with a
  step) and its last one falls short of the last step a rank that exited 0 reported.
  Without steps to compare it is judged done: every collective it took part in
  completed (the others exited 0 after them), and it then did nothing for the whole
  bound.

The controller then stops the attempt with the hung ranks' stacks captured, as an
``ExitHang`` fault. When every hung rank's work was done the job completes (it
succeeds, with the fault, its stacks and this judgement on record); otherwise the
restart policy takes the fault like any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from trainguard.control.events import Fault, FaultType
from trainguard.wire.status import NodeStatus, Progress, WorkerState, WorkerStatus

__all__ = [
    "DEFAULT_TIMEOUT",
    "IDLE_CPU_FRACTION",
    "STEP_FACTOR",
    "ExitWatch",
    "Lingering",
    "step_seconds",
]

DEFAULT_TIMEOUT: Final = 60.0
"""Seconds a rank may go on running after every other rank exited 0 (the floor)."""
STEP_FACTOR: Final = 20.0
"""The bound is at least this many of the attempt's mean step times."""
IDLE_CPU_FRACTION: Final = 0.05
"""CPU seconds per second below which a lingering rank is idle (a deadlocked process
uses none; gloo's waiting thread wakes every 5 ms, far below this)."""


@dataclass(frozen=True)
class Lingering:
    """What the watch found past the bound: ``hung`` ranks (node, rank), or only ``busy``
    ones (still computing: left alone)."""

    since: float
    bound: float
    hung: tuple[tuple[str, int], ...]
    busy: tuple[tuple[str, int], ...]
    done_step: int | None  # the last step any rank that exited 0 reported
    steps: Mapping[int, int]  # each hung rank's last step, where it reported one

    @property
    def unfinished(self) -> tuple[int, ...]:
        """Hung ranks whose last step fell short of the others' (their work was not done).
        A rank that never reported a step (only rank 0 prints, say) is not judged by steps."""
        done = self.done_step
        if done is None:
            return ()
        return tuple(r for _, r in self.hung if r in self.steps and self.steps[r] < done)

    @property
    def finished(self) -> bool:
        return bool(self.hung) and not self.unfinished

    def message(self, now: float) -> str:
        ranks = ", ".join(f"rank {r} ({n})" for n, r in self.hung or self.busy)
        waited = now - self.since
        if not self.hung:
            return (
                f"{ranks} still running {waited:.0f}s after every other rank exited 0; "
                "left to finish: it is using CPU"
            )
        verdict = (
            "its work was done"
            if self.finished
            else f"ranks {list(self.unfinished)} had not reached step {self.done_step}"
        )
        return (
            f"ExitHang: {ranks} still running {waited:.0f}s after every other rank exited 0 "
            f"(bound {self.bound:g}s), idle; {verdict}"
        )

    def one(self) -> tuple[str | None, int | None]:
        """The (node, rank) when there is a single one, else (None, None)."""
        ranks = self.hung or self.busy
        return ranks[0] if len(ranks) == 1 else (None, None)

    def fault(self, now: float, attempt: int, step: int | None) -> Fault:
        """The ExitHang fault of the hung ranks."""
        node, rank = self.one()
        message = self.message(now)
        return Fault(FaultType.EXIT_HANG, now, attempt, node, rank, step, message, self.evidence())

    def evidence(self) -> dict[str, Any]:
        return {
            "lingering_since": self.since,
            "bound": self.bound,
            "ranks": [r for _, r in self.hung],
            "nodes": sorted({n for n, _ in self.hung}),
            "done_step": self.done_step,
            "last_steps": {str(r): s for r, s in self.steps.items()},
            "finished": self.finished,
            "unfinished": list(self.unfinished),
            "judged_by": "steps" if self.done_step is not None and self.steps else "idle",
        }


def step_seconds(progress: Progress | None) -> float | None:
    """The attempt's mean seconds per step so far, when it completed more than one."""
    if progress is None or progress.step <= progress.first_step:
        return None
    return (progress.time - progress.first_time) / (progress.step - progress.first_step)


class ExitWatch:
    """Watches one attempt for ranks that outlive the others (see the module doc)."""

    def __init__(
        self,
        timeout: float | None,
        *,
        step_factor: float = STEP_FACTOR,
        idle_fraction: float = IDLE_CPU_FRACTION,
    ) -> None:
        """``timeout``: the bound's floor; None: never."""
        self.timeout = timeout
        self.step_factor = step_factor
        self.idle_fraction = idle_fraction
        self._key: frozenset[int] | None = None
        self._since = 0.0
        self._cpu: dict[int, float | None] = {}

    def bound(self, progress: Progress | None) -> float:
        floor = self.timeout or 0.0
        per_step = step_seconds(progress)
        return floor if per_step is None else max(floor, self.step_factor * per_step)

    def observe(
        self,
        now: float,
        expected: int,
        current: Sequence[tuple[str, NodeStatus]],
        progress: Progress | None,
    ) -> Lingering | None:
        """``expected``: how many nodes the attempt has (``current`` holds those that are
        up and report it). Returns what is past the bound, else None."""
        if self.timeout is None:
            return None
        lingering = _lingering(expected, current)
        if lingering is None:
            self._key = None
            return None
        running, done = lingering
        key = frozenset(w.rank for _, w in running)
        if key != self._key:  # the others' last exit (or a new set): the bound starts
            self._restart(now, key, running)
            return None
        bound = self.bound(progress)
        if now - self._since < bound:
            return None
        since = self._since
        busy = tuple((n, w.rank) for n, w in running if not self._idle(now, w))
        if busy:
            self._restart(now, key, running)  # look again a whole bound later
            return Lingering(since, bound, (), busy, None, {})
        steps = _last_steps(current)
        done_steps = [steps[w.rank] for w in done if w.rank in steps]
        return Lingering(
            since,
            bound,
            tuple((n, w.rank) for n, w in running),
            (),
            max(done_steps) if done_steps else None,
            {w.rank: steps[w.rank] for _, w in running if w.rank in steps},
        )

    def _restart(
        self, now: float, key: frozenset[int], running: Sequence[tuple[str, WorkerStatus]]
    ) -> None:
        self._key, self._since = key, now
        self._cpu = {w.rank: w.cpu_seconds for _, w in running}

    def _idle(self, now: float, worker: WorkerStatus) -> bool:
        before, after = self._cpu.get(worker.rank), worker.cpu_seconds
        if before is None or after is None:
            return True  # not reported: the bound alone decides
        return after - before < self.idle_fraction * max(now - self._since, 1e-9)


def _lingering(
    expected: int, current: Sequence[tuple[str, NodeStatus]]
) -> tuple[list[tuple[str, WorkerStatus]], list[WorkerStatus]] | None:
    """(running ranks with their node, ranks that exited 0) when the attempt lingers."""
    if len(current) < expected:
        return None
    running: list[tuple[str, WorkerStatus]] = []
    done: list[WorkerStatus] = []
    for node_id, status in current:
        for w in status.workers:
            if w.state is WorkerState.RUNNING:
                running.append((node_id, w))
            elif w.state is WorkerState.SUCCEEDED:
                done.append(w)
            else:
                return None
    return (running, done) if running and done else None


def _last_steps(current: Sequence[tuple[str, NodeStatus]]) -> dict[int, int]:
    """Each rank's last reported step: its progress lines, or its heartbeats' steps."""
    steps: dict[int, int] = {}
    for _, status in current:
        for rank, (step, _t) in status.monitor.rank_steps.items():
            steps[rank] = max(step, steps.get(rank, step))
        for rank, beat in status.heartbeats.items():
            if beat.step is not None:
                steps[rank] = max(beat.step, steps.get(rank, beat.step))
    return steps
