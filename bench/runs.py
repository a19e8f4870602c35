"""Launching ``bench/train.py``: under trainguard (a job spec) and under torchrun (2 agents).

Both sides run the same script with the same arguments, 2 nodes x 2 processes on
loopback, and write their step records to ``<workdir>/out/steps.txt``. Every process a
run starts leads its own session, so :meth:`stop` can always clean up after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from bench.steps import StepRecord, read_steps

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "bench" / "train.py"
NNODES = 2
NPROC_PER_NODE = 2
STOP_TIMEOUT = 20.0
"""Seconds a stopped run gets to exit before everything it started is SIGKILLed."""


@dataclass(frozen=True)
class TrainArgs:
    """The training script's arguments (``--ckpt`` is the launcher's choice)."""

    script: ClassVar[Path] = TRAIN  # a subclass may run another script (bench/workloads.py)
    steps: int
    step_sleep: float = 0.05
    hidden: int = 256
    ckpt_every: int = 10
    log_all_ranks: bool = False  # every rank prints a progress line (rank 0 always does)

    def argv(self, out: Path, ckpt: str) -> list[str]:
        return [
            *(["--log-all-ranks"] if self.log_all_ranks else []),
            "--steps",
            str(self.steps),
            "--step-sleep",
            str(self.step_sleep),
            "--hidden",
            str(self.hidden),
            "--ckpt",
            ckpt,
            "--ckpt-every",
            str(self.ckpt_every),
            "--out",
            str(out),
        ]


class Run:
    """One launch; subclasses say how. ``launched_at`` is the Unix time of the launch."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.out = workdir / "out"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.launched_at = 0.0

    def steps(self) -> list[StepRecord]:
        return read_steps(self.out / "steps.txt")

    def wait(self, timeout: float) -> bool:
        """True when every launched process exited within ``timeout``."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    @property
    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        """SIGCONT, then SIGTERM everything this run started; SIGKILL what is left."""
        # Only unreaped children: a reaped child's pid may belong to someone else by now.
        tree = [proc for p in self.procs if p.poll() is None for proc in process_tree(p.pid)]
        for proc in tree:
            proc.signal(signal.SIGCONT)
        for launched in self.procs:
            if launched.poll() is None:
                launched.send_signal(signal.SIGTERM)
        if not self.wait(STOP_TIMEOUT):
            for proc in tree:
                proc.signal(signal.SIGKILL)
            self.wait(STOP_TIMEOUT)
        for proc in tree:  # workers lead their own sessions: a killed agent orphans them
            proc.signal(signal.SIGKILL)

    def _spawn(self, argv: Sequence[str], log: str, env: dict[str, str] | None = None) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / log, "ab") as out:
            self.procs.append(
                subprocess.Popen(
                    argv,
                    cwd=REPO,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob("*.log")))


class TorchrunRun(Run):
    """torchrun as two nodes: two agents meeting at a c10d rendezvous on loopback."""

    def __init__(
        self,
        workdir: Path,
        args: TrainArgs,
        run_id: str,
        max_restarts: int = 0,
        ckpt: str = "torch",
    ) -> None:
        super().__init__(workdir)
        self.args = args
        self.run_id = run_id
        self.max_restarts = max_restarts
        self.ckpt = ckpt
        self.ckpt_dir = workdir / "ckpt"

    def start(self, port: int) -> None:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NNODES),
            "--nproc-per-node",
            str(NPROC_PER_NODE),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            self.run_id,
            "--max-restarts",
            str(self.max_restarts),
            str(self.args.script),
            *self.args.argv(self.out, self.ckpt),
            "--ckpt-dir",
            str(self.ckpt_dir),
        ]
        self.launched_at = time.time()
        for node in range(NNODES):
            self._spawn(argv, f"{self.run_id}-node{node}.log")

    def rank_process(self, rank: int) -> Proc | None:
        """The live worker process of global ``rank`` (read from its environment)."""
        for agent in [p for p in self.procs if p.poll() is None]:
            for proc in process_tree(agent.pid)[1:]:
                env = _environ(proc.pid)
                if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RUN_ID") == self.run_id:
                    return proc
        return None


@dataclass(frozen=True)
class TrainguardJob:
    """What differs between the benchmarks' trainguard jobs."""

    name: str
    retries: int = 0
    log_rules: list[dict[str, Any]] = field(default_factory=list)
    memory_every_steps: int = 10
    spec_fields: dict[str, Any] = field(default_factory=dict)  # more of ``spec`` (a variant's)
    ckpt: str = "trainguard"  # the script's --ckpt

    def spec(self, args: TrainArgs, out: Path) -> dict[str, Any]:
        command = ["python", str(args.script), *args.argv(out, self.ckpt)]
        job: dict[str, Any] = {
            "apiVersion": "trainguard.dev/v1",
            "kind": "TrainingJob",
            "metadata": {"name": self.name},
            "spec": {
                "nprocPerNode": str(NPROC_PER_NODE),
                "replicaSpecs": [
                    {
                        "name": "pods",
                        "replicas": NNODES,
                        "template": {
                            "spec": {"containers": [{"name": "trainer", "command": command}]}
                        },
                    }
                ],
                "runPolicy": {
                    "jobMaxRetryCount": self.retries,
                    "logMonitoringConfiguration": self.log_rules,
                },
                "checkpointing": {"memoryEverySteps": self.memory_every_steps},
            },
        }
        job["spec"].update(self.spec_fields)
        return job


class TrainguardRun(Run):
    """``trainguard run -f job.yaml [--inject ...]`` in a private state directory."""

    def __init__(self, workdir: Path, args: TrainArgs, job: TrainguardJob) -> None:
        super().__init__(workdir)
        self.args = args
        self.job = job
        self.env = {"TRAINGUARD_STATE_DIR": str(workdir / "state")}

    def start(self, injections: Sequence[str] = ()) -> None:
        spec = self.workdir / "job.yaml"
        self.workdir.mkdir(parents=True, exist_ok=True)
        spec.write_text(yaml.safe_dump(self.job.spec(self.args, self.out)))
        argv = [sys.executable, "-m", "trainguard.cli", "run", "-f", str(spec)]
        for injection in injections:
            argv += ["--inject", injection]
        self.launched_at = time.time()
        self._spawn(argv, "trainguard.log", self.env)

    def interrupt(self) -> None:
        """Ctrl-C: trainguard stops every worker, then exits."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    def describe(self) -> dict[str, Any]:
        """``trainguard describe JOB -o json`` of this run's only job."""
        jobs = json.loads(self._cli("list", "-o", "json"))
        if len(jobs) != 1:
            raise RuntimeError(f"{self.workdir}: expected one job, found {len(jobs)}")
        data: dict[str, Any] = json.loads(self._cli("describe", jobs[0]["id"], "-o", "json"))
        return data

    def _cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", *args],
            cwd=REPO,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"trainguard {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout


def event_times(job: dict[str, Any], kind: str) -> list[float]:
    """Times of a described job's events of ``kind``, oldest first."""
    return sorted(float(e["time"]) for e in job["events"] if e["kind"] == kind)


@dataclass(frozen=True)
class Proc:
    """A process as seen once: its pid and start time, so a reused pid is never signalled."""

    pid: int
    started: str

    def signal(self, sig: signal.Signals) -> None:
        if _start_time(self.pid) == self.started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def process_tree(pid: int) -> list[Proc]:
    """``pid`` and its live descendants (from ``/proc``), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[Proc] = []
    todo = [pid]
    while todo:
        current = todo.pop(0)
        started = _start_time(current)
        if started is not None:
            found.append(Proc(current, started))
        todo += children.get(current, [])
    return found


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state, ppid, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}
