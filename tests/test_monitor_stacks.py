"""Python stacks of real worker-like processes: running, sleeping, stopped, gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.monitor.stacks import capture_stacks, find_py_spy, process_state

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")

SLEEPER = """
import time
def wait_in_collective():
    while True:
        time.sleep(5)  # asleep but for an instant every 5 s: seen "S" even on a busy machine
print("ready", flush=True)
wait_in_collective()
"""

SPINNER = """
def spin_forever():
    x = 0
    while True:
        x += 1
print("ready", flush=True)
spin_forever()
"""


def start(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(timeout=30)


def wait_state(pid: int, letters: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        letter, line = process_state(pid)
        if letter is not None and letter in letters:
            return
        assert time.monotonic() < deadline, line
        time.sleep(0.01)


def test_stacks_of_sleeping_running_and_stopped_workers(
    procs: list[subprocess.Popen[str]],
) -> None:
    sleeping, spinning, stopped = start(SLEEPER), start(SPINNER), start(SLEEPER)
    procs += [sleeping, spinning, stopped]
    os.kill(stopped.pid, signal.SIGSTOP)  # how a hang is injected
    wait_state(stopped.pid, "T")

    stacks = capture_stacks({0: sleeping.pid, 1: spinning.pid, 2: stopped.pid}, timeout=60)

    assert set(stacks) == {0, 1, 2}
    assert "state S (sleeping)" in stacks[0]
    assert "wait_in_collective" in stacks[0]
    assert "spin_forever" in stacks[1]
    assert f"pid {stopped.pid} " in stacks[2]
    assert "state T (stopped)" in stacks[2]
    assert "do_signal_stop" in stacks[2]  # wchan
    assert "wait_in_collective" in stacks[2]
    assert "--nonblocking" in stacks[2]
    assert process_state(stopped.pid)[0] == "T"  # never continued


def test_gone_and_zombie_processes_are_explained(procs: list[subprocess.Popen[str]]) -> None:
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], text=True)
    procs.append(zombie)
    wait_state(zombie.pid, "Z")  # exited, not reaped
    gone = 2**22 + 12345  # above the default pid_max
    stacks = capture_stacks({0: zombie.pid, 1: gone}, timeout=30)
    assert "state Z (zombie)" in stacks[0]
    assert "exited" in stacks[0]
    assert "no such process" in stacks[1]


def test_no_pids() -> None:
    assert capture_stacks({}) == {}


def test_process_state_of_self() -> None:
    letter, line = process_state(os.getpid())
    assert letter == "R"
    assert line.startswith(f"pid {os.getpid()} (")
    assert Path(f"/proc/{os.getpid()}/wchan").exists()
