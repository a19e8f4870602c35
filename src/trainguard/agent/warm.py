"""Warm worker starts: the agent's side of the worker template.

A :class:`WorkerTemplate` keeps one template process (:mod:`trainguard.agent.template`)
per agent: it imports torch and the script's other installed modules once, while the
agent waits for its first start, then forks every worker of every attempt, hot spares
included. A process restart then costs a fork, not an interpreter and ``import torch``.

:class:`Spawner` is what a worker group starts processes with: through the template
where it can, else (not a Python command, warm starts off, the template not ready in
time or dead) a fresh exec through the exec shim, as before. Either way a worker is
a :class:`Process` (``pid``, ``poll()``, ``wait()``), leads its own session and dies
with the agent's supervisor thread: the template dies with that thread, and its
workers with the template.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from trainguard.agent.preload import warm_command
from trainguard.agent.train_scripts import TrainScripts
from trainguard.platform.procs import alive

logger = logging.getLogger(__name__)

READY_TIMEOUT = 120.0  # a template importing for longer than this is given up
FORK_TIMEOUT = 10.0


class Process(Protocol):
    """A worker process as the agent needs it; ``subprocess.Popen`` is one."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class WarmProcess:
    """A worker forked by the template: its exit code comes from the template."""

    def __init__(self, pid: int, argv: Sequence[str]) -> None:
        self._pid = pid
        self.args = list(argv)
        self._code: int | None = None
        self._done = threading.Event()

    @property
    def pid(self) -> int:
        return self._pid

    def exited(self, code: int) -> None:
        if self._code is None:
            self._code = code
        self._done.set()

    def poll(self) -> int | None:
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self._code is not None
        return self._code


@dataclass(frozen=True)
class StartOptions:
    """How an agent starts its workers (``spec.trainguard.warmStart``/``preloadModules``)."""

    warm: bool = True
    preload: tuple[str, ...] = ()
    scripts: TrainScripts = field(default_factory=TrainScripts)  # pre/post-train commands

    def agent_flags(self) -> list[str]:
        """The agent's command-line flags that ask for these options."""
        flags = [] if self.warm else ["--cold-start"]
        for name in self.preload:
            flags += ["--preload", name]
        return flags + self.scripts.agent_flags()


WARM_STARTS = StartOptions()
FRESH_STARTS = StartOptions(warm=False)


class WorkerTemplate:
    """One template process and the thread that reads its messages.

    Start it on the supervisor thread: the template's parent-death signal follows the
    thread that forked it.
    """

    def __init__(
        self,
        worker_argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None,
        log_file: Path,
        *,
        preload: Sequence[str] = (),
        on_exit: Callable[[], None] = lambda: None,
    ) -> None:
        """``env``: the workers' common environment (the agent's, with the job's values),
        under which the modules are imported; ``on_exit``: called after a worker's exit
        code arrived (the supervisor looks at once)."""
        self._on_exit = on_exit
        self._log_file = log_file  # the template's output; its readiness is said there too
        self._lock = threading.Lock()
        self._replies: dict[int, dict[str, object]] = {}
        self._replied = threading.Condition(self._lock)
        self._workers: dict[int, WarmProcess] = {}
        self._early: dict[int, int] = {}  # exits that arrived before the fork reply
        self._next_id = 0
        self._ready = threading.Event()
        self._ok = False
        self._closed = False
        self._closing = False  # close() was called: the workers' deaths are expected
        self.why_not: str | None = None  # why the template is not used, once known
        self.preloaded: list[str] = []
        ours, theirs = socket.socketpair()
        self._sock = ours
        log_file.parent.mkdir(parents=True, exist_ok=True)
        args = ["--parent-pid", str(os.getpid()), "--fd", str(theirs.fileno())]
        for name in preload:
            args += ["--preload", name]
        with open(log_file, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.agent.template", *args, "--", *worker_argv],
                env={**os.environ, **env},
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=[theirs.fileno()],
                start_new_session=True,
            )
        theirs.close()
        self._reader = threading.Thread(target=self._read, name="trainguard-template", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def importing(self) -> bool:
        """Still importing: a worker asked for now waits for it."""
        return not self._ready.is_set()

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> bool:
        """Whether the template serves forks (waits for its imports, at most ``timeout``)."""
        if not self._ready.wait(timeout):
            self.why_not = f"not ready within {timeout:.0f} s"
            logger.warning("worker template %s; starting workers fresh", self.why_not)
            self.close()
        return self._ok

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: Path, stderr: Path
    ) -> WarmProcess:
        """Fork a worker; ``OSError`` if the template cannot (the caller starts it fresh)."""
        with self._lock:
            if not self._ok or self._closed:
                raise OSError(f"worker template unavailable: {self.why_not}")
            ident, self._next_id = self._next_id, self._next_id + 1
            request = {
                "fork": ident,
                "argv": list(argv),
                "env": dict(env),
                "cwd": str(cwd),
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
            try:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError as exc:
                raise OSError(f"worker template unreachable: {exc}") from exc
            deadline = time.monotonic() + FORK_TIMEOUT
            while ident not in self._replies and not self._closed:
                if not self._replied.wait(max(0.0, deadline - time.monotonic())):
                    break
            reply = self._replies.pop(ident, None)
            if reply is None:
                raise OSError("worker template did not answer a fork request")
            pid = reply.get("pid")
            if not isinstance(pid, int):
                raise OSError(f"worker template could not fork: {reply.get('error')}")
            process = WarmProcess(pid, argv)
            self._workers[pid] = process
            if pid in self._early:
                process.exited(self._early.pop(pid))
            return process

    def close(self) -> None:
        """End the template (its live workers die with it: the caller stops them first)."""
        with self._lock:
            self._closed = self._closing = True
            self._replied.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5.0)

    # -- the reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self._sock.recv(1 << 16)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._message(json.loads(line))
        except (OSError, ValueError) as exc:
            logger.warning("worker template connection failed: %s", exc)
        finally:
            self._gone()

    def _message(self, message: dict[str, object]) -> None:
        if "ready" in message:
            self._ok = message["ready"] is True
            if self._ok:
                self.preloaded = [str(m) for m in message.get("preloaded") or []]  # type: ignore[attr-defined]
                seconds = message.get("seconds")
                self._note(
                    logging.INFO,
                    "worker template ready in %.2f s (preloaded %s)",
                    seconds if isinstance(seconds, int | float) else 0.0,
                    ", ".join(self.preloaded) or "nothing",
                )
            else:
                self.why_not = str(message.get("why"))
                self._note(
                    logging.WARNING, "no worker template: %s; starting workers fresh", self.why_not
                )
            self._ready.set()
        elif "forked" in message:
            ident = message["forked"]
            with self._lock:
                if isinstance(ident, int):
                    self._replies[ident] = message
                self._replied.notify_all()
        elif "exited" in message:
            pid, code = message["exited"], message.get("code")
            if isinstance(pid, int) and isinstance(code, int):
                with self._lock:
                    process = self._workers.pop(pid, None)
                    if process is None:
                        self._early[pid] = code
                if process is not None:
                    process.exited(code)
                    self._on_exit()

    def _note(self, level: int, text: str, *args: object) -> None:
        """Log a line, and add it to the template's log file, where its output is."""
        logger.log(level, text, *args)
        with contextlib.suppress(OSError), open(self._log_file, "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text % args}\n")

    def _gone(self) -> None:
        """The template exited: its workers die of their parent-death signal."""
        with self._lock:
            self._closed = True
            if self.why_not is None:
                self.why_not = "the template exited"
            orphans, self._workers = self._workers, {}
            self._replied.notify_all()
        self._ready.set()
        if orphans and not self._closing:
            logger.error("worker template died; its %d workers die with it", len(orphans))
        for pid, process in orphans.items():
            _wait_gone(pid, 5.0)
            process.exited(-signal.SIGKILL)
        if orphans:
            self._on_exit()


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


class Spawner:
    """Starts workers: forked from the template where it can, fresh otherwise."""

    def __init__(
        self,
        worker_argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None,
        log_file: Path,
        options: StartOptions = StartOptions(),
        on_exit: Callable[[], None] = lambda: None,
    ) -> None:
        """Call on the supervisor thread (it may start the template); ``log_file``: the
        template's output (its imports' warnings, a worker that could not start)."""
        self._cwd = cwd
        self.template: WorkerTemplate | None = None
        self.why_cold: str | None = None
        if not options.warm:
            self.why_cold = "warm starts are off (spec.trainguard.warmStart: false)"
        elif warm_command(worker_argv) is None:
            self.why_cold = "the worker command is not `python [-u] SCRIPT|-m MODULE`"
        else:
            try:
                self.template = WorkerTemplate(
                    worker_argv, env, cwd, log_file, preload=options.preload, on_exit=on_exit
                )
            except OSError as exc:
                self.why_cold = f"the worker template could not start: {exc}"
        if self.why_cold is not None:
            logger.info("workers start fresh: %s", self.why_cold)

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path
    ) -> Process | None:
        """A worker forked from the template, or None: start it fresh."""
        template = self.template
        if template is None or not template.wait_ready():
            return None
        try:
            return template.spawn(argv, env, self._cwd or Path.cwd(), stdout, stderr)
        except OSError as exc:
            logger.warning("%s; starting the worker fresh", exc)
            return None

    @property
    def warming(self) -> bool:
        """The template is still importing: a worker started now would wait for it."""
        return self.template is not None and self.template.importing

    def close(self) -> None:
        if self.template is not None:
            self.template.close()
