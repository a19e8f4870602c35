"""One attempt's worker processes on this node: started, watched, stopped.

Each worker is forked from the agent's worker template (:mod:`trainguard.agent.warm`)
or runs through the exec shim (:mod:`trainguard.agent.exec_worker`); either way the
kernel kills it when the agent thread that started it (or its template) exits; hence
:meth:`WorkerGroup.start` must run on the agent's long-lived supervisor thread, never
on a short-lived request thread. Every worker leads its own session (and process
group), gets torchrun's environment plus ``TORCHELASTIC_ERROR_FILE`` (where torch
elastic's ``@record`` writes the error of a failing worker), and writes stdout and
stderr to the attempt's files in :class:`~trainguard.agent.logs.LogLayout`.

A failed worker's error (its fault's reason) is what its error file says, else the
exception line of the last Python traceback in its stderr (:func:`last_exception`):
``ValueError: bad lr``, not only "exit code 1".

Plain ``subprocess``: the agent supervises, it never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from trainguard.agent.logs import ATTEMPT_MARKER, STREAMS, LogLayout
from trainguard.agent.warm import Process, Spawner
from trainguard.wire.requests import NodeAssignment

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
MAX_ERROR_CHARS = 2000
MAX_TRACEBACK_CHARS = 8000
TRACEBACK_TAIL_BYTES = 64 * 1024
"""How much of the end of a failed worker's stderr (and rank log) is searched for its
traceback."""
HOST_WORKERS_ENV = "TRAINGUARD_HOST_WORKERS"
"""Set by a platform whose nodes share one host (local simulated nodes): how many workers
run on it in all. Read by the agent (``OMP_NUM_THREADS``), never passed to workers."""
_TRACEBACK = "Traceback (most recent call last):"
# torch.distributed's excepthook prefixes every line of a traceback with ``[rankN]: ``.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")

Spawned = Callable[[int], None]
"""Called with the pid of every process the group starts (the agent watches its exit)."""


def reserved_env_keys() -> frozenset[str]:
    """Worker environment names the agent sets itself (``--env`` may not override them)."""
    probe = NodeAssignment(
        job_id="probe",
        node_id="probe",
        attempt=0,
        nnodes=1,
        node_rank=0,
        nproc_per_node=1,
        master_addr="probe",
        master_port=1,
        restart_count=0,
        max_restarts=0,
    )
    return frozenset(probe.worker_env(0)) | {ERROR_FILE_ENV}


def worker_envs(
    assignment: NodeAssignment,
    agent_env: Mapping[str, str],
    inherited: Mapping[str, str] = os.environ,
) -> dict[int, dict[str, str]]:
    """Each local rank's environment on top of ``inherited`` (the agent's own).

    The agent's ``--env`` values, then the assignment's torchrun contract; what torchrun
    adds when nobody set it: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, and
    ``OMP_NUM_THREADS=1`` when several workers share the host: this node's, or every
    worker of the host where the platform says how many (``TRAINGUARD_HOST_WORKERS``:
    simulated nodes on one machine; torchrun counts one node's only, so each of 2 nodes x
    1 process would start a thread per core). ``TORCHELASTIC_ERROR_FILE`` is added per
    process.
    """
    base = dict(agent_env)
    host_workers = _count(base.pop(HOST_WORKERS_ENV, None))
    sharing = max(assignment.nproc_per_node, host_workers)
    envs: dict[int, dict[str, str]] = {}
    for local_rank in range(assignment.nproc_per_node):
        env = dict(base)
        env.update(assignment.worker_env(local_rank))
        for name, value, wanted in (
            ("OMP_NUM_THREADS", "1", sharing > 1),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", True),
        ):
            if wanted and name not in inherited and name not in env:
                env[name] = value
        envs[local_rank] = env
    return envs


def _count(text: str | None) -> int:
    """A count from the environment (0 when absent or not a number)."""
    try:
        return max(0, int(text or 0))
    except ValueError:
        return 0


def shim_args(agent_pid: int, worker_argv: Sequence[str], cwd: Path | None) -> tuple[str, ...]:
    """Arguments to ``sys.executable`` that run ``worker_argv`` through the exec shim."""
    args = ["-m", "trainguard.agent.exec_worker", "--parent-pid", str(agent_pid)]
    if cwd is not None:
        args += ["--cwd", str(cwd)]
    return (*args, "--", *worker_argv)


def read_error_message(path: str | Path) -> str | None:
    """The message of a torch elastic error file, or None if absent or unreadable."""
    try:
        data = json.loads(Path(path).read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message:
        return None
    return message[:MAX_ERROR_CHARS]


def last_exception(lines: Sequence[str]) -> str | None:
    """The exception line (``ValueError: bad lr``) of the last Python traceback in
    ``lines`` (a ``[rankN]: `` prefix, torch's, is read through), or None."""
    block = _last_traceback_lines(lines)
    return block[-1].rstrip()[:MAX_ERROR_CHARS] if block else None


def last_traceback(lines: Sequence[str]) -> str | None:
    """The last Python traceback in ``lines`` (prefixes read through), up to and with its
    exception line; where it is longer than ``MAX_TRACEBACK_CHARS``, its end."""
    block = _last_traceback_lines(lines)
    if not block:
        return None
    return "\n".join(line.rstrip() for line in block)[-MAX_TRACEBACK_CHARS:]


def _last_traceback_lines(lines: Sequence[str]) -> list[str]:
    text = [_RANK_PREFIX.sub("", line, count=1) for line in lines]
    starts = [i for i, line in enumerate(text) if line.startswith(_TRACEBACK)]
    if not starts:
        return []
    for end in range(starts[-1] + 1, len(text)):
        line = text[end]
        if line.strip() and not line[0].isspace():
            return text[starts[-1] : end + 1]
    return []


def tail_lines(path: Path, size: int = TRACEBACK_TAIL_BYTES) -> list[str]:
    """The complete lines in the last ``size`` bytes of ``path`` ([] if it cannot be read).
    A stream file's parts already read by the tailer may be holes (zeros): dropped."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(0, end - size))
            data = f.read(size)
    except OSError:
        return []
    lines = data.replace(b"\0", b"").decode("utf-8", errors="replace").splitlines()
    return lines[1:] if end > size else lines


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pid`` leads (every worker leads its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@dataclass
class WorkerProcess:
    """One worker process: its output files (stream -> path) and its error file."""

    proc: Process
    paths: dict[str, Path]
    error_file: Path
    files: list[IO[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close_files(self) -> None:
        for f in self.files:
            f.close()
        self.files.clear()


def spawn_worker(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | None,
    log_dir: Path,
    spawner: Spawner | None = None,
) -> WorkerProcess:
    """Start ``argv`` in its own session, its output appended to
    ``log_dir/{stdout,stderr}.log``; ``log_dir/error.json`` is its error file.

    Forked from ``spawner``'s template where it can (a warm start), else through the
    exec shim (a fresh interpreter)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    paths = {stream: log_dir / f"{stream}.log" for stream in STREAMS}
    error_file = log_dir / "error.json"
    error_file.unlink(missing_ok=True)  # a re-run attempt must not see a stale one
    full_env = {**os.environ, **env, ERROR_FILE_ENV: str(error_file)}
    if spawner is not None:
        warm = spawner.spawn(argv, full_env, paths["stdout"], paths["stderr"])
        if warm is not None:
            return WorkerProcess(warm, paths, error_file)
    files: list[IO[bytes]] = [open(paths[s], "ab") for s in STREAMS]  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, *shim_args(os.getpid(), argv, cwd)],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=files[0],
            stderr=files[1],
            start_new_session=True,
        )
    except BaseException:
        for f in files:
            f.close()
        raise
    return WorkerProcess(proc, paths, error_file, files)


class WorkerGroup:
    """The workers of one attempt on this node, one per local rank."""

    def __init__(
        self,
        assignment: NodeAssignment,
        worker_argv: Sequence[str],
        layout: LogLayout,
        *,
        agent_env: Mapping[str, str],
        cwd: Path | None,
        reap_timeout: float,
        spawned: Spawned = lambda pid: None,
        spawner: Spawner | None = None,
    ) -> None:
        """``reap_timeout``: how long to wait for a process to vanish after SIGKILL;
        ``spawner``: forks warm workers (None: every worker starts fresh)."""
        self.assignment = assignment
        self.ranks = dict(enumerate(assignment.global_ranks))  # local -> global
        self._argv = list(worker_argv)
        self._layout = layout
        self._agent_env = dict(agent_env)
        self._cwd = cwd
        self._reap_timeout = reap_timeout
        self._spawned = spawned
        self._spawner = spawner
        self._workers: dict[int, WorkerProcess] = {}  # local rank -> its current process
        self._exitcodes: dict[int, int] = {}  # local rank -> exit of its current process

    def start(self) -> dict[int, int]:
        """Start every worker; returns local rank -> pid. Call on the supervisor thread."""
        if self._workers:
            raise RuntimeError("worker group already started")
        a = self.assignment
        envs = worker_envs(a, self._env(a))
        for local, rank in self.ranks.items():
            self._workers[local] = self._spawn(envs[local], self._layout.rank_dir(a.attempt, rank))
        return self.pids()

    def pids(self) -> dict[int, int]:
        return {local: w.pid for local, w in self._workers.items()}

    def running(self) -> bool:
        """Whether any of the group's processes still runs."""
        return any(p.proc.poll() is None for p in self._processes())

    def poll(self) -> dict[int, int]:
        """Workers that exited since the last call: local rank -> exit code (<0: signal)."""
        new: dict[int, int] = {}
        for local, worker in self._workers.items():
            if local not in self._exitcodes and (code := worker.proc.poll()) is not None:
                self._exitcodes[local] = new[local] = code
        return new

    def all_exited(self) -> bool:
        return len(self._exitcodes) == len(self.ranks)

    def settling(self) -> bool:
        """Whether :meth:`poll` waits for something no exit wakes (look often); False:
        only exits change it, and the supervisor is woken by them."""
        return False

    def error_message(self, local: int) -> str | None:
        """What the worker's error file says (torch elastic's ``@record``), else the
        exception of the last traceback it wrote to stderr: where the log tailer has not
        read it yet, its stderr file; where it has (and gave the file's space back), the
        rank's log since this attempt's marker."""
        worker = self._workers.get(local)
        if worker is None:
            return None
        message = read_error_message(worker.error_file)
        return message if message is not None else self._from_output(local, last_exception)

    def error_traceback(self, local: int) -> str | None:
        """The last Python traceback the worker wrote (its stderr, else the rank's log
        since this attempt's marker), its end kept where it is long."""
        return self._from_output(local, last_traceback)

    def _from_output(
        self, local: int, extract: Callable[[Sequence[str]], str | None]
    ) -> str | None:
        worker = self._workers.get(local)
        if worker is None:
            return None
        found = extract(tail_lines(worker.paths["stderr"]))
        if found is None:
            rank_log = tail_lines(self._layout.combined(self.ranks[local]))
            marker = ATTEMPT_MARKER.format(attempt=self.assignment.attempt)
            since = max((i for i, line in enumerate(rank_log) if line == marker), default=-1)
            found = extract(rank_log[since + 1 :])
        return found

    def close(self, first_signal: signal.Signals, grace: float) -> dict[int, int]:
        """Signal every live process's group, SIGKILL after ``grace``; returns the exits
        this caused (local rank -> exit code)."""
        live = [p for p in self._processes() if p.proc.poll() is None]
        for p in live:
            # A stopped worker (SIGSTOP: a hang, a debugger) cannot act on SIGTERM until it
            # is continued; without this a graceful stop would always wait out the grace.
            signal_group(p.pid, signal.SIGCONT)
            signal_group(p.pid, first_signal)
        deadline = time.monotonic() + grace
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.0, deadline - time.monotonic()))
        for p in live:
            if p.proc.poll() is None:
                signal_group(p.pid, signal.SIGKILL)
            try:
                p.proc.wait(self._reap_timeout)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d survived SIGKILL", p.pid)
        return self.poll()

    def finish(self) -> dict[int, str]:
        """Error messages by local rank (failed workers); kills what the workers left
        behind in their process groups."""
        errors: dict[int, str] = {}
        for local in self._workers:
            if self._exitcodes.get(local) and (message := self.error_message(local)):
                errors[local] = message
        for p in self._processes():
            signal_group(p.pid, signal.SIGKILL)
            p.close_files()
        return errors

    # -- for subclasses ---------------------------------------------------------------

    def _processes(self) -> list[WorkerProcess]:
        return list(self._workers.values())

    def _env(self, a: NodeAssignment) -> dict[str, str]:
        return dict(self._agent_env)

    def _spawn(self, env: Mapping[str, str], log_dir: Path) -> WorkerProcess:
        worker = spawn_worker(self._argv, env, self._cwd, log_dir, self._spawner)
        self._spawned(worker.pid)
        return worker
