"""The baselines' side: torchrun relaunched like a job scheduler would, and faults injected here.

trainguard injects its own faults (``--inject``); for torchrun the benchmark does it,
the same way: it watches the step records and signals the worker of a global rank
(found by its environment) once a step is reached, or at times after the first step.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.runs import Proc, TorchrunRun, TrainArgs
from bench.steps import StepRecord

POLL_SECONDS = 0.05
"""How often the benchmark checks the step records and processes."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Relaunch:
    """torchrun started again after every failure, until a launch succeeds or :meth:`stop`.

    Every launch resumes from the script's own ``torch.save`` checkpoint (a shared
    directory) and writes to the same step records; ``exits`` holds when each failed
    launch had fully exited, which is when the next one starts.
    """

    def __init__(self, workdir: Path, args: TrainArgs, max_launches: int = 50) -> None:
        self.workdir = workdir
        self.args = args
        self.max_launches = max_launches
        self.runs: list[TorchrunRun] = []
        self.exits: list[float] = []
        self.succeeded = False
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="relaunch", daemon=True)

    @property
    def launched_at(self) -> float:
        return self.runs[0].launched_at

    def steps(self) -> list[StepRecord]:
        return self.runs[0].steps() if self.runs else []

    def start(self) -> None:
        self._launch()
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            current = self.runs[-1]
        current.stop()
        self._thread.join()

    def rank_process(self, rank: int) -> Proc | None:
        with self._lock:
            current = self.runs[-1]
        return current.rank_process(rank)

    def log_text(self) -> str:
        return self.runs[0].log_text() if self.runs else ""

    def _launch(self) -> None:
        with self._lock:  # never after stop() took the current run
            if self._stopping.is_set():
                return
            run = TorchrunRun(self.workdir, self.args, run_id=f"relaunch{len(self.runs)}")
            self.runs.append(run)
            run.start(free_port())

    def _loop(self) -> None:
        while not self._stopping.is_set():
            run = self.runs[-1]
            if not run.wait(POLL_SECONDS * 4):
                continue
            if all(code == 0 for code in run.returncodes):
                self.succeeded = True
                return
            self.exits.append(time.time())
            if len(self.runs) >= self.max_launches:
                return
            self._launch()


Target = Callable[[int], Proc | None]
"""Finds the live worker process of a global rank."""


def signal_at_step(
    steps: Callable[[], Sequence[StepRecord]],
    target: Target,
    rank: int,
    step: int,
    sig: signal.Signals,
    timeout: float,
) -> float | None:
    """Signal ``rank`` once step ``step`` completed; the time it was signalled, None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = steps()
        if records and max(r.step for r in records) >= step and (proc := target(rank)):
            proc.signal(sig)
            return time.time()
        time.sleep(POLL_SECONDS)
    return None


def signal_at_times(
    steps: Callable[[], Sequence[StepRecord]],
    target: Target,
    rank: int,
    offsets: Sequence[float],
    sig: signal.Signals,
    until: float,
) -> list[float]:
    """Signal ``rank`` at each offset (s) after the first completed step, until ``until``.

    An offset whose rank is not running (a launch is starting) waits for it, as
    trainguard's injector does. Returns the times the signals were sent.
    """
    sent: list[float] = []
    pending = sorted(offsets)
    first: float | None = None
    while pending and time.time() < until:
        if first is None:
            records = steps()
            first = min((r.end for r in records), default=None)
        if first is not None and time.time() >= first + pending[0]:
            proc = target(rank)
            if proc is not None:
                proc.signal(sig)
                sent.append(time.time())
                pending.pop(0)
                continue
        time.sleep(POLL_SECONDS)
    return sent
