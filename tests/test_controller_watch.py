"""The agent's (and the store service's) watch on its controller sleeps without a tick
and still sees the controller's end, an attach and a wake-up at once (issue 41).

Real processes: a ``sleep`` child plays the controller and is SIGKILLed; it is reaped
only after the watch has seen it end (a zombie is gone, not alive).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from trainguard.agent.controller_watch import ControllerWatch, start_ticks


def test_the_controllers_end_and_an_attach_each_end_the_sleep_at_once() -> None:
    controller = subprocess.Popen(["sleep", "600"])
    other = subprocess.Popen(["sleep", "600"])
    watch = ControllerWatch(controller.pid, grace=30.0)
    try:
        assert watch.expired() is None
        began = time.monotonic()
        watch.wait(0.3)  # alive: it sleeps the whole time it is given
        assert time.monotonic() - began >= 0.25

        threading.Timer(0.2, os.kill, (controller.pid, signal.SIGKILL)).start()
        began = time.monotonic()
        watch.wait(60.0)  # not reaped yet: a zombie
        assert time.monotonic() - began < 30.0
        assert watch.expired() is None  # gone, within its grace
        assert watch.gone_for() is not None

        threading.Timer(0.2, watch.attach, (other.pid, start_ticks(other.pid))).start()
        began = time.monotonic()
        watch.wait(60.0)  # the grace (30 s) would end it later
        assert time.monotonic() - began < 20.0
        assert watch.expired() is None
        assert watch.gone_for() is None  # the new controller lives

        threading.Timer(0.2, watch.wakeup.wake).start()
        began = time.monotonic()
        watch.wait(60.0)
        assert time.monotonic() - began < 30.0
    finally:
        for proc in (controller, other):
            proc.kill()
            proc.wait()
        watch.close()
        watch.wakeup.close()


def test_once_the_grace_is_over_the_watch_says_why() -> None:
    controller = subprocess.Popen(["sleep", "600"])
    watch = ControllerWatch(controller.pid, grace=0.5)
    try:
        controller.kill()
        controller.wait()
        deadline = time.monotonic() + 30.0
        while (why := watch.expired()) is None and time.monotonic() < deadline:
            watch.wait(deadline - time.monotonic())
        assert why is not None and f"pid {controller.pid}" in why
    finally:
        watch.close()
        watch.wakeup.close()
