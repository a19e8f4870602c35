"""Step-triggered fault injection, carried out by the agent that runs the rank.

``trainguard run --inject kill:rank=3@step=40`` means: kill rank 3 when it has completed
step 40. The controller sees progress only as often as it polls, so it would hit steps
late (at step 74 of a 10 ms/step job); the agent reads each line its workers print, so
it hits the named step within one. The controller hands these injections to every agent
(``POST /inject``); the agent running the rank fires each once, when a progress line of
any of its node's ranks shows the step, reports it in its status (``injected``), and
never fires it again. Where the rank's node prints no progress (only rank 0 of a job
does, say), the controller fires it from the job's progress, as it does the others.
Seconds-triggered injections and node kills stay with the controller
(:mod:`trainguard.platform.inject`).

While an injection is armed for one of its ranks, the agent reads the workers' output
every :data:`FAST_TAIL_INTERVAL` instead of its usual interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from trainguard.monitor.lines import split_lines
from trainguard.monitor.progress import DEFAULT_PROGRESS_PATTERN, ProgressMatcher
from trainguard.platform.actuate import SignalActuator
from trainguard.platform.inject import signal_rank
from trainguard.wire.requests import StepInjection
from trainguard.wire.status import InjectedFault

logger = logging.getLogger(__name__)

FAST_TAIL_INTERVAL = 0.002
"""How often the log tailer reads while an injection is armed (s): well within a step."""


class StepInjector:
    """The injections armed on this node, and the ones it fired."""

    def __init__(self, on_fired: Callable[[], None] = lambda: None) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, StepInjection] = {}
        self._fired: dict[int, InjectedFault] = {}
        self._matcher = ProgressMatcher()
        self._pids: Mapping[int, int] = {}  # global rank -> pid of its current process
        self._actuator = SignalActuator()
        self._on_fired = on_fired

    def arm(self, injections: Sequence[StepInjection]) -> None:
        """Hold exactly these (except any that fired already)."""
        with self._lock:
            self._armed = {i.id: i for i in injections if i.id not in self._fired}

    def attempt(self, progress_pattern: str | None, pids: Mapping[int, int]) -> None:
        """A new attempt's progress pattern and its ranks' pids (global rank -> pid)."""
        with self._lock:
            self._matcher = ProgressMatcher(progress_pattern or DEFAULT_PROGRESS_PATTERN)
            self._pids = dict(pids)

    def took_over(self, pids: Mapping[int, int]) -> None:
        """New processes run these ranks now (global rank -> pid)."""
        with self._lock:
            self._pids = {**self._pids, **pids}

    def armed_for(self, ranks: Sequence[int]) -> bool:
        with self._lock:
            return any(i.rank in ranks for i in self._armed.values())

    @property
    def fired(self) -> tuple[InjectedFault, ...]:
        with self._lock:
            return tuple(self._fired[k] for k in sorted(self._fired))

    def on_lines(self, rank: int, stream: str, block: bytes, t: float) -> None:
        """Whole worker lines (the tailer's thread): each as :meth:`on_line`, while an
        injection is armed for a rank of this node (else nothing is read)."""
        with self._lock:
            if not any(i.rank in self._pids for i in self._armed.values()):
                return
        for line in split_lines(block):
            self.on_line(rank, stream, line.decode(errors="replace"), t)

    def on_line(self, rank: int, stream: str, line: str, t: float) -> None:
        """A worker's output line (the tailer's thread): fire what its step makes due.

        The step is the node's: any of its ranks' progress lines counts (a DDP job's ranks
        move together, and often only one of them prints its progress)."""
        with self._lock:
            if not any(i.rank in self._pids for i in self._armed.values()):
                return
            step = self._matcher.match(line)
            if step is None:
                return
            due = [
                (i, self._pids[i.rank])
                for i in self._armed.values()
                if i.rank in self._pids and step >= i.at_step
            ]
        for injection, pid in due:
            if not signal_rank(self._actuator, injection.kind, pid):
                continue  # that process is gone: wait for the rank's next one
            fired = InjectedFault(
                id=injection.id, rank=injection.rank, step=step, pid=pid, time=time.time()
            )
            with self._lock:
                self._armed.pop(injection.id, None)
                self._fired[injection.id] = fired
            logger.warning(
                "injected %s of rank %d (pid %d) at step %d",
                injection.kind, injection.rank, pid, step,
            )  # fmt: skip
            self._on_fired()

    def close(self) -> None:
        """End throttles and continue stopped workers (so that they can be stopped)."""
        self._actuator.close()
