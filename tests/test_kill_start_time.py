"""A pid learnt from elsewhere (an agent's status, the store) is signalled only while its
start time is still the one taken when the pid was first seen: a process that reuses the
pid later is never signalled (issue 16: `delete` once SIGKILLed such a process).

Pid reuse cannot be forced, so a reused pid is played by a live process whose start time
was taken wrong when it was first seen (as if the pid had then named another process).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import pid_alive, wait_for
from trainguard.platform import actuate, procs
from trainguard.platform.actuate import SignalActuator, _Process
from trainguard.platform.node import LocalNode
from trainguard.platform.procs import pin, start_time
from trainguard.platform.resume import AdoptedNode, LiveAgent

Spawn = Callable[[], subprocess.Popen[bytes]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Processes each leading its own group (like agents and workers); killed after."""
    started: list[subprocess.Popen[bytes]] = []

    def one() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        started.append(proc)
        return proc

    yield one
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def reused(pid: int) -> str:
    """A start time ``pid``'s process does not have: as if the pid had been reused."""
    started = start_time(pid)
    assert started is not None
    boot, ticks = started.rsplit(":", 1)
    return f"{boot}:{int(ticks) - 1}"


def killed(proc: subprocess.Popen[bytes]) -> bool:
    return proc.wait(10) == -9


def seen_reused(monkeypatch: pytest.MonkeyPatch, setter: Callable[[], None], pid: int) -> None:
    """Run ``setter`` (which first sees ``pid``) while ``pid`` reads as another process."""
    real = procs.start_time
    with monkeypatch.context() as m:
        m.setattr(procs, "start_time", lambda p: reused(p) if p == pid else real(p))
        setter()


def test_pin_takes_a_start_time_when_a_pid_is_first_seen(spawn: Spawn) -> None:
    proc = spawn()
    first = pin([proc.pid])
    assert first == {proc.pid: start_time(proc.pid)}
    assert pin([proc.pid], {proc.pid: "boot:1"}) == {proc.pid: "boot:1"}  # kept, not re-read


def test_local_node_shutdown_signals_only_workers_still_first_seen(
    spawn: Spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = subprocess.Popen([sys.executable, "-c", "pass"])
    agent.wait()  # gone already: only its workers are left
    node = LocalNode("node-0", "inc", agent, tmp_path / "node-0.port")
    same, other = spawn(), spawn()
    node.last_pids = (same.pid,)
    seen_reused(monkeypatch, lambda: setattr(node, "last_pids", (same.pid, other.pid)), other.pid)
    node.last_pids = (same.pid, other.pid)  # seen again: the first start time stays
    node.shutdown(None)
    assert killed(same)
    assert other.poll() is None and pid_alive(other.pid)


def test_adopted_node_shutdown_checks_the_agent_and_its_workers(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, impostor, worker, stranger = spawn(), spawn(), spawn(), spawn()

    def adopted(pid: int, started: str | None) -> AdoptedNode:
        return AdoptedNode(LiveAgent("node-0", 0, "http://127.0.0.1:1", pid, started, "inc"))

    fake = adopted(impostor.pid, reused(impostor.pid))
    assert not fake.alive()
    fake.shutdown(None)
    real = adopted(agent.pid, start_time(agent.pid))
    real.last_pids = (worker.pid,)
    seen_reused(
        monkeypatch, lambda: setattr(real, "last_pids", (worker.pid, stranger.pid)), stranger.pid
    )
    real.shutdown(None)
    assert killed(agent) and killed(worker)
    for proc in (impostor, stranger):
        assert proc.poll() is None and pid_alive(proc.pid)


def test_node_kill_signals_only_pids_whose_start_time_matches(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, worker, stranger = spawn(), spawn(), spawn()
    real_pin = procs.pin

    def pin_with_a_reused(pids: list[int]) -> dict[int, str | None]:
        return {**real_pin(pids), stranger.pid: reused(stranger.pid)}

    monkeypatch.setattr(actuate, "pin", pin_with_a_reused)
    actuator = SignalActuator()
    assert actuator.kill_node(agent.pid, [worker.pid, stranger.pid])
    assert killed(agent) and killed(worker)
    assert stranger.poll() is None and pid_alive(stranger.pid)
    # An agent pid that names another process now: nothing is signalled.
    monkeypatch.setattr(
        actuate, "pin", lambda pids: {p: reused(p) if p == stranger.pid else None for p in pids}
    )
    assert not actuator.kill_node(stranger.pid, [])
    assert stranger.poll() is None
    actuator.close()


def test_an_injection_target_pinned_to_another_process_is_not_signalled(spawn: Spawn) -> None:
    proc = spawn()
    target = _Process(proc.pid)
    target.start = reused(proc.pid)
    assert not target.send(signal.SIGKILL)
    assert proc.poll() is None
    assert _Process(proc.pid).send(signal.SIGKILL)
    wait_for(lambda: proc.poll() is not None, timeout=10)
    assert proc.returncode == -9
