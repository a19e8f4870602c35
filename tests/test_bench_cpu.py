"""bench/cpu.py: the launcher's CPU counts the launcher's own processes, not its workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from bench.cpu import LAUNCHER, WORKER, CpuSampler, role

# Sleeps as the launcher would look between a fork and an exec (its command line, no
# RANK), then execs into a worker (RANK set) that spins, as a training rank does.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    time.sleep(1.0)
    env = dict(os.environ, RANK="0")
    os.execve(sys.executable, [sys.executable, "-c",
              "import time\\nend = time.time() + 30\\nwhile time.time() < end: pass"], env)
    """
)


def test_a_worker_first_seen_before_its_exec_is_not_the_launchers() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env)
    sampler = CpuSampler(lambda: [child.pid], interval=0.1)
    try:
        deadline = time.monotonic() + 60
        while role(child.pid) != LAUNCHER and time.monotonic() < deadline:
            time.sleep(0.01)
        sampler.start()  # it sees the child as the launcher's first
        while role(child.pid) != WORKER and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # the worker spins
        start = time.time()
        time.sleep(1.5)
        rate = sampler.launcher_rate(start, time.time())
    finally:
        sampler.stop()
        child.kill()
        child.wait()
    assert rate is not None
    assert rate < 20.0, f"the worker's spinning counted as the launcher's: {rate} CPU s/min"
