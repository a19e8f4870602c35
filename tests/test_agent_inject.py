"""The agent's step injector: fires at the rank's own line, once, only for its ranks."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from trainguard.agent.inject import StepInjector
from trainguard.wire.requests import StepInjection


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_fires_at_the_named_step_once(sleeper: subprocess.Popen[bytes]) -> None:
    nudges: list[int] = []
    injector = StepInjector(on_fired=lambda: nudges.append(1))
    kill = StepInjection(id=4, kind="kill", rank=3, at_step=40)
    injector.arm([kill])
    injector.attempt(None, {3: sleeper.pid})
    assert injector.armed_for([2, 3]) and not injector.armed_for([0, 1])
    injector.on_line(3, "stdout", "Step 39", 0.0)
    injector.on_line(3, "stdout", "loss 40", 0.0)  # not a progress line
    assert sleeper.poll() is None and injector.fired == ()
    injector.on_line(2, "stdout", "Step 40", 0.0)  # the node's other rank: the same step
    assert sleeper.wait(10) == -signal.SIGKILL
    [fired] = injector.fired
    assert (fired.id, fired.rank, fired.step, fired.pid) == (4, 3, 40, sleeper.pid)
    assert nudges == [1]
    injector.arm([kill])  # the controller has not seen it fire yet: still never again
    assert not injector.armed_for([3])


def test_a_custom_progress_pattern_and_a_rank_without_a_process() -> None:
    injector = StepInjector()
    injector.arm([StepInjection(id=0, kind="hang", rank=1, at_step=2)])
    injector.attempt(r"it=(\d+)", {})
    injector.on_line(0, "stdout", "it=5", 0.0)  # due, but rank 1 runs nowhere here
    assert injector.fired == () and injector.armed_for([1])
