"""How often a DDP script hangs at its end, by how its workers start (a diagnostic).

    python -m bench.exit_race --mode cold --runs 30
    python -m bench.exit_race --mode cold-dynamo --runs 30     # torch._dynamo imported first
    python -m bench.exit_race --mode warm-unguarded --runs 30  # forked as the template did
    python -m bench.exit_race --mode warm --runs 30            # trainguard's worker template

Each run starts ``--ranks`` gloo ranks of ``tests/scripts/conformance/ddp_object.py``
(torchrun's tutorial shape: 4 epochs of 2048 samples) on this machine and waits up to
``--timeout`` seconds; a run whose ranks do not all end is hung, and each hung rank is
classified from ``py-spy dump --native``: ``gloo-join`` is the deadlock
:mod:`trainguard.agent.script_end` describes (``~ProcessGroupGloo`` joining a thread that
waits for the GIL). Modes: ``cold`` a fresh ``python -u`` per rank; ``cold-dynamo`` the
same with ``torch._dynamo`` imported before the script; ``warm-unguarded`` forked from
this process after importing torch and torch._dynamo and run as the template ran scripts
before ``GroupKeeper``; ``warm`` forked by trainguard's template (``Spawner``). Prints one
JSON line. Not part of ``make bench``: it counts, it times nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainguard.agent.warm import Process, Spawner
from trainguard.monitor.stacks import find_py_spy
from trainguard.platform.procs import free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "conformance" / "ddp_object.py"
MODES = ("cold", "cold-dynamo", "warm-unguarded", "warm")


class Forked:
    """A rank forked from this process (``warm-unguarded``)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid = os.fork()
        if self.pid == 0:  # the child: run the script as the template did, unguarded
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.environ.clear()
            os.environ.update(env)
            import runpy

            sys.argv = argv[2:]
            try:
                runpy.run_path(argv[2], run_name="__main__")
            except BaseException:
                os._exit(1)
            os._exit(0)
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code


def start(mode: str, spawner: Spawner | None, argv: list[str], env: dict[str, str]) -> Any:
    if mode == "warm":
        assert spawner is not None
        proc = spawner.spawn(argv, env, Path(os.devnull), Path(os.devnull))
        if proc is None:
            raise SystemExit(f"the template cannot fork: {spawner.why_cold}")
        return proc
    if mode == "warm-unguarded":
        return Forked(argv, env)
    if mode == "cold-dynamo":
        code = (
            "import runpy, sys, torch._dynamo; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        argv = [argv[0], "-u", "-c", code, *argv[2:]]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def classify(pid: int) -> str:
    spy = find_py_spy()
    if spy is None:
        return "unknown (no py-spy)"
    dump = subprocess.run(
        [spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    if "~ProcessGroupGloo" in dump and "gil_scoped_acquire" in dump:
        return "gloo-join"
    return "other"


def one_run(mode: str, spawner: Spawner | None, ranks: int, timeout: float) -> list[str]:
    """The hung ranks' classes ([] when every rank ended)."""
    port = free_port()
    out = tempfile.mkdtemp(prefix="exit-race-")
    argv = [sys.executable, "-u", str(SCRIPT), "4", "2048"]
    procs: list[Process | Forked] = []
    for rank in range(ranks):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", OUT=out)  # fmt: skip
        procs.append(start(mode, spawner, argv, env))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    hung = [classify(p.pid) for p in procs if p.poll() is None]
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    shutil.rmtree(out, ignore_errors=True)
    return hung


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exit_race", description=__doc__)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    spawner = None
    if args.mode == "warm":
        argv0 = [sys.executable, "-u", str(SCRIPT)]
        spawner = Spawner(argv0, {}, SCRIPT.parent, Path("/tmp/exit-race-template.log"))
    elif args.mode == "warm-unguarded":
        import torch._dynamo  # noqa: F401  (what the template preloads)
    hung: list[list[str]] = []
    try:
        for _ in range(args.runs):
            hung.append(one_run(args.mode, spawner, args.ranks, args.timeout))
    finally:
        if spawner is not None:
            spawner.close()
    runs_hung = [h for h in hung if h]
    print(json.dumps({
        "mode": args.mode, "runs": args.runs, "ranks": args.ranks, "hung_runs": len(runs_hung),
        "gloo_join_runs": sum(1 for h in runs_hung if "gloo-join" in h),
        "hung_ranks": [h for h in runs_hung],
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
