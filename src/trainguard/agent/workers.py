"""One attempt's worker processes on this node, started with torch elastic.

Built on ``torch.distributed.elastic.multiprocessing.start_processes`` with a
binary entry point (so a ``SubprocessContext``) and our own ``LogsSpecs``.
Every worker runs through the exec shim (:mod:`trainguard.agent.exec_worker`),
which makes the kernel kill it when the agent thread that forked it exits.
Hence :meth:`WorkerGroup.start` must run on the agent's long-lived supervisor
thread, never on a short-lived request thread.

Worker exits are polled from the context's subprocess handlers rather than
through ``PContext.wait(0)`` while workers run: on the first failure torch's
poll closes the peers itself with a fixed 30 s grace, blocking the caller, and
then reports the peers it killed as failures too. We close them ourselves with
our own grace, and ask torch for its result once everyone has exited.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, start_processes

from trainguard.agent.logs import LogLayout
from trainguard.control.assignment import NodeAssignment

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
MAX_ERROR_CHARS = 2000


def reserved_env_keys() -> frozenset[str]:
    """Worker environment names the agent sets itself (``--env`` may not override them)."""
    probe = NodeAssignment(
        job_id="probe",
        node_id="probe",
        attempt=0,
        node_rank=0,
        nnodes=1,
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
    """Each local rank's environment on top of ``inherited`` (torch merges ``os.environ``).

    The agent's ``--env`` values, then the assignment's torchrun contract;
    ``OMP_NUM_THREADS=1`` when several workers share the node and nobody set it
    (torchrun's rule). ``TORCHELASTIC_ERROR_FILE`` is added by the logs specs.
    """
    envs: dict[int, dict[str, str]] = {}
    for local_rank in range(assignment.nproc_per_node):
        env = dict(agent_env)
        env.update(assignment.worker_env(local_rank))
        if (
            assignment.nproc_per_node > 1
            and "OMP_NUM_THREADS" not in inherited
            and "OMP_NUM_THREADS" not in env
        ):
            env["OMP_NUM_THREADS"] = "1"
        envs[local_rank] = env
    return envs


def shim_args(agent_pid: int, worker_argv: Sequence[str], cwd: Path | None) -> tuple[str, ...]:
    """Arguments to ``sys.executable`` that run ``worker_argv`` through the exec shim."""
    args = ["-m", "trainguard.agent.exec_worker", "--parent-pid", str(agent_pid)]
    if cwd is not None:
        args += ["--cwd", str(cwd)]
    return (*args, "--", *worker_argv)


class AttemptLogsSpecs(LogsSpecs):  # type: ignore[misc]  # torch is untyped here
    """Puts each worker's stdout/stderr/error file where :class:`LogLayout` says; no tee."""

    def __init__(self, layout: LogLayout, attempt: int, global_ranks: Sequence[int]) -> None:
        super().__init__(log_dir=str(layout.root))
        self._layout = layout
        self._attempt = attempt
        self._global_ranks = list(global_ranks)

    @property
    def root_log_dir(self) -> str:
        return str(self._layout.root)

    def reify(self, envs: dict[int, dict[str, str]]) -> Any:
        stdouts: dict[int, str] = {}
        stderrs: dict[int, str] = {}
        error_files: dict[int, str] = {}
        for local_rank, env in envs.items():
            rank = self._global_ranks[local_rank]
            self._layout.rank_dir(self._attempt, rank).mkdir(parents=True, exist_ok=True)
            error_file = self._layout.error_file(self._attempt, rank)
            error_file.unlink(missing_ok=True)  # a re-run attempt must not see a stale one
            stdouts[local_rank] = str(self._layout.stdout(self._attempt, rank))
            stderrs[local_rank] = str(self._layout.stderr(self._attempt, rank))
            error_files[local_rank] = str(error_file)
            # torch's LogsSpecs sets this in reify, so ours must too.
            env[ERROR_FILE_ENV] = str(error_file)
        return LogsDest(stdouts=stdouts, stderrs=stderrs, error_files=error_files)


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


class WorkerGroup:
    """The workers of one attempt on this node (one per local rank)."""

    def __init__(
        self,
        assignment: NodeAssignment,
        worker_argv: Sequence[str],
        layout: LogLayout,
        *,
        agent_env: Mapping[str, str],
        cwd: Path | None,
        reap_timeout: float,
    ) -> None:
        """``reap_timeout``: how long to wait for a process to vanish after SIGKILL."""
        self.assignment = assignment
        self.ranks = dict(enumerate(assignment.global_ranks))  # local -> global
        self._worker_argv = list(worker_argv)
        self._layout = layout
        self._agent_env = dict(agent_env)
        self._cwd = cwd
        self._reap_timeout = reap_timeout
        self._pcontext: Any = None
        self._exitcodes: dict[int, int] = {}

    def start(self) -> dict[int, int]:
        """Start every worker; returns local rank -> pid. Call on the supervisor thread."""
        if self._pcontext is not None:
            raise RuntimeError("worker group already started")
        attempt = self.assignment.attempt
        args = shim_args(os.getpid(), self._worker_argv, self._cwd)
        self._pcontext = start_processes(
            name="trainguard",
            entrypoint=sys.executable,
            args=dict.fromkeys(self.ranks, args),
            envs=worker_envs(self.assignment, self._agent_env),
            logs_specs=AttemptLogsSpecs(self._layout, attempt, self.assignment.global_ranks),
        )
        return self.pids()

    def pids(self) -> dict[int, int]:
        return {} if self._pcontext is None else dict(self._pcontext.pids())

    def poll(self) -> dict[int, int]:
        """Workers that exited since the last call: local rank -> exit code (<0: signal)."""
        new: dict[int, int] = {}
        if self._pcontext is None:
            return new
        for local_rank, handler in self._pcontext.subprocess_handlers.items():
            if local_rank in self._exitcodes:
                continue
            code = handler.proc.poll()
            if code is not None:
                self._exitcodes[local_rank] = new[local_rank] = code
        return new

    def all_exited(self) -> bool:
        return len(self._exitcodes) == len(self.ranks)

    def close(self, first_signal: signal.Signals, grace: float) -> dict[int, int]:
        """Send ``first_signal`` to every live worker's process group, SIGKILL after ``grace``.

        Returns the exits this caused (local rank -> exit code).
        """
        if self._pcontext is None:
            return {}
        if first_signal is not signal.SIGKILL:
            # A stopped worker (SIGSTOP: a hang, a debugger) cannot act on SIGTERM until it
            # is continued; without this a graceful stop would always wait out the grace.
            for handler in self._pcontext.subprocess_handlers.values():
                if handler.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(handler.proc.pid, signal.SIGCONT)
        try:
            self._pcontext.close(death_sig=first_signal, timeout=grace)
        except OSError:  # killpg failed: a worker left the process group torch gave it
            logger.exception("closing the workers through torch failed; killing them directly")
            for handler in self._pcontext.subprocess_handlers.values():
                if handler.proc.poll() is None:
                    handler.proc.kill()
        for local_rank, handler in self._pcontext.subprocess_handlers.items():
            try:
                handler.proc.wait(self._reap_timeout)
            except subprocess.TimeoutExpired:
                logger.error(
                    "worker local_rank %d (pid %d) survived SIGKILL", local_rank, handler.proc.pid
                )
        self._sweep()
        return self.poll()

    def finish(self) -> dict[int, str]:
        """Torch's verdict once every worker has exited: error messages by local rank.

        Also kills whatever the workers left behind in their process groups.
        """
        errors: dict[int, str] = {}
        if self._pcontext is None:
            return errors
        try:
            result = self._pcontext.wait(0)
        except Exception:  # e.g. a malformed error file; ProcessFailure raises on it
            logger.exception("torch could not report the workers' result; reading error files")
            result = None
        if result is not None:
            for local_rank, failure in result.failures.items():
                message = read_error_message(failure.error_file)
                if message is not None:
                    errors[local_rank] = message
        else:
            for local_rank, error_file in self._pcontext.error_files.items():
                message = read_error_message(error_file)
                if message is not None and self._exitcodes.get(local_rank):
                    errors[local_rank] = message
        self._pcontext.close(timeout=0)
        self._sweep()
        return errors

    def _sweep(self) -> None:
        """SIGKILL the workers' process groups: children they left must not outlive them."""
        for pid in self.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
