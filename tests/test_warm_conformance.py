"""Warm starts end the way fresh interpreters do: each script of ``tests/scripts/conformance``
(a pattern real torchrun scripts use) runs forked from a worker template and as a fresh
``python``, and both must end the same way: exit codes, output, the files it wrote.

The DDP cases repeat (20 warm runs with the model at module level, 8 in an object): the
tutorial-shaped DDP script hung in 21 of 30 warm runs before
:mod:`trainguard.agent.script_end` (a torch deadlock when a DDP Reducer frees its gloo
group under the GIL; ``python -m bench.exit_race`` measures it at 4 ranks), and this
suite's smaller ``ddp_object`` case hung at its 6th warm run without the fix. A run that
does not end within its timeout fails with the ranks' stacks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainguard.agent.warm import Process, Spawner
from trainguard.monitor.stacks import capture_stacks
from trainguard.platform.procs import free_port

PY = sys.executable
SCRIPTS = Path(__file__).resolve().parent / "scripts" / "conformance"
RUN_TIMEOUT = 180.0  # one run of a case, all its ranks: generous, machines are shared

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Case:
    script: str
    ranks: int = 1
    args: tuple[str, ...] = ()
    warm_runs: int = 2
    cold_runs: int = 1
    unbuffered: bool = True
    sigterm: bool = False  # signal the worker once it wrote OUT/ready

    def argv(self) -> list[str]:
        flags = ["-u"] if self.unbuffered else []
        return [PY, *flags, str(SCRIPTS / self.script), *self.args]


CASES = {
    "ddp_module": Case("ddp_module.py", ranks=2, warm_runs=20, cold_runs=2),
    "ddp_object": Case("ddp_object.py", ranks=2, args=("2",), warm_runs=8, cold_runs=2),
    "ddp_forgotten": Case("ddp_forgotten.py", ranks=2, warm_runs=3),
    "fsdp2": Case("fsdp2.py", ranks=2),
    "dataloader_workers": Case("dataloader_workers.py"),
    "mp_spawn": Case("mp_spawn.py"),
    "atexit_threads": Case("atexit_threads.py", warm_runs=3),
    "exit_code": Case("exit_code.py"),
    "uncaught": Case("uncaught.py"),
    "keyboard_interrupt": Case("keyboard_interrupt.py"),
    "sigterm_handler": Case("sigterm_handler.py", sigterm=True),
    "main_guard": Case("main_guard.py", args=("--flag", "x")),
    "compiled": Case("compiled.py", warm_runs=1),
    "buffered_exit": Case("buffered_exit.py", unbuffered=False),
}


# torch's own log lines (glog style) start with the time and the pid: not the script's.
_TORCH_LOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", re.MULTILINE)


def normalized(text: str) -> str:
    return _TORCH_LOG.sub(r"\1 ", text)


@dataclass(frozen=True)
class Outcome:
    """How one run ended: per rank its exit code, stdout, stderr; the files it wrote."""

    codes: tuple[int, ...]
    stdout: tuple[str, ...]
    stderr: tuple[str, ...]
    files: dict[str, str]


def env_for(case: Case, rank: int, port: int, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(OUT=str(out), OMP_NUM_THREADS="1")
    if case.ranks > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(case.ranks),
            LOCAL_WORLD_SIZE=str(case.ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    return env


Start = Callable[[list[str], dict[str, str], Path, Path], Process]


def run(case: Case, out: Path, start: Start) -> Outcome:
    """One run of ``case``; ``start(argv, env, stdout, stderr)`` starts a rank."""
    out.mkdir(parents=True)
    port = free_port()
    procs: list[Process] = []
    for rank in range(case.ranks):
        logs = out.parent / f"{out.name}-{rank}.out", out.parent / f"{out.name}-{rank}.err"
        procs.append(start(case.argv(), env_for(case, rank, port, out), *logs))
    if case.sigterm:
        ready = out / "ready"
        deadline = time.monotonic() + RUN_TIMEOUT
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(procs[0].pid, signal.SIGTERM)
    codes = wait_all(procs, out)
    return Outcome(
        codes,
        tuple((out.parent / f"{out.name}-{r}.out").read_text() for r in range(case.ranks)),
        tuple(
            normalized((out.parent / f"{out.name}-{r}.err").read_text()) for r in range(case.ranks)
        ),
        {p.name: p.read_text() for p in sorted(out.iterdir()) if p.name != "ready"},
    )


TEARDOWN_ABORT = "terminate called without an active exception"
"""What torch's own teardown prints when it aborts a process at exit now and then (a
joinable C++ thread destroyed: seen once in CI, in a fresh interpreter's FSDP2 run, after
the script had finished and written its result). Not how a script ends."""


def settled(case: Case, out: Path, start: Start, tries: int = 3) -> Outcome:
    """:func:`run`, again (into ``out-again-N``) while a rank died of torch's teardown
    abort (SIGABRT with :data:`TEARDOWN_ABORT`), cold or warm alike."""
    outcome = run(case, out, start)
    for n in range(1, tries):
        aborted = any(
            code == -signal.SIGABRT and TEARDOWN_ABORT in err
            for code, err in zip(outcome.codes, outcome.stderr, strict=True)
        )
        if not aborted:
            break
        outcome = run(case, out.with_name(f"{out.name}-again-{n}"), start)
    return outcome


def wait_all(procs: Sequence[Process], out: Path) -> tuple[int, ...]:
    deadline = time.monotonic() + RUN_TIMEOUT
    codes: list[int | None] = [None] * len(procs)
    while time.monotonic() < deadline and None in codes:
        codes = [p.poll() for p in procs]
        time.sleep(0.05)
    if None in codes:
        hung = {r: p.pid for r, p in enumerate(procs) if codes[r] is None}
        stacks = capture_stacks(hung)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"{out.name}: ranks {sorted(hung)} did not end in {RUN_TIMEOUT:g}s:\n"
                    + "\n".join(stacks.values()))  # fmt: skip
    return tuple(c for c in codes if c is not None)


def cold_start(argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> Process:
    with stdout.open("w") as o, stderr.open("w") as e:
        return subprocess.Popen(
            argv,
            env=env,
            cwd=SCRIPTS,
            stdout=o,
            stderr=e,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


@pytest.fixture(params=sorted(CASES), ids=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture
def template(case: Case, tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(case.argv(), {}, SCRIPTS, tmp_path / "template.log")
    yield spawner
    spawner.close()


def test_a_warm_worker_ends_as_a_fresh_interpreter_does(
    case: Case, template: Spawner, tmp_path: Path
) -> None:
    def warm_start(argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> Process:
        proc = template.spawn(argv, env, stdout, stderr)
        assert proc is not None, (tmp_path / "template.log").read_text()
        return proc

    cold = [settled(case, tmp_path / f"cold-{n}", cold_start) for n in range(case.cold_runs)]
    warm = [settled(case, tmp_path / f"warm-{n}", warm_start) for n in range(case.warm_runs)]
    expected = cold[0]
    for n, outcome in enumerate([*cold[1:], *warm]):
        label = f"run {n + 1} of {len(cold) + len(warm)}"
        assert outcome.codes == expected.codes, label
        assert outcome.stdout == expected.stdout, label
        assert outcome.stderr == expected.stderr, label
        assert outcome.files == expected.files, label
