"""The worker template: a process that has imported the workers' modules and forks them.

    python -m trainguard.agent.template --parent-pid PID --fd FD [--preload MOD]... \\
        -- WORKER_ARGV...

A node agent starts one (see :mod:`trainguard.agent.warm`). It imports torch, the other
installed modules the worker script imports, and ``--preload`` modules, then serves fork
requests on the socket ``--fd``: each request is one worker, forked from this warm
interpreter and run the way ``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE
ARGS`` would run it, with the request's argv, environment and working directory. The
worker skips the interpreter start and the imports: most of a process restart's stall.

The worker leads its own session, dies with this process (``PR_SET_PDEATHSIG``, as the
exec shim's workers die with their agent thread; this process dies with that thread),
and its exit code is this process's to reap: it is sent to the agent.

Stdlib only, plus what it is asked to preload; it never initialises CUDA or a process
group, and it stays single-threaded (a fork copies only the forking thread).

One JSON object per line, both ways::

    <- {"ready": true, "preloaded": [...], "seconds": 2.1}   (or "ready": false, "why")
    -> {"fork": 7, "argv": [...], "env": {...}, "cwd": "...", "stdout": P, "stderr": P}
    <- {"forked": 7, "pid": 4242}                          (or "forked": 7, "error")
    <- {"exited": 4242, "code": -9}                        (negative: killed by a signal)
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import random
import selectors
import signal
import socket
import sys
import time
import types
from dataclasses import dataclass
from typing import TextIO

from trainguard.agent.exec_worker import set_parent_death_signal
from trainguard.agent.preload import WarmCommand, fork_unsafe_reason, preload, warm_command
from trainguard.agent.script_end import GroupKeeper

EXIT_USAGE = 2
EXIT_PARENT_GONE = 1
EXIT_SETUP = 126

_KEPT: list[object] = []


# -- the worker, after the fork ------------------------------------------------------------


@dataclass(frozen=True)
class ForkRequest:
    id: int
    command: WarmCommand
    env: dict[str, str]
    cwd: str
    stdout: str
    stderr: str


def parse_request(line: bytes) -> ForkRequest:
    data = json.loads(line)
    command = warm_command(data["argv"])
    if command is None:
        raise ValueError(f"not a command a template runs: {data['argv']!r}")
    env = data["env"]
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("env must map strings to strings")
    return ForkRequest(
        int(data["fork"]), command, env, str(data["cwd"]), str(data["stdout"]), str(data["stderr"])
    )


def become_worker(request: ForkRequest, template_pid: int) -> None:
    """In the forked child: take the worker's session, files, environment and directory."""
    os.setsid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != template_pid:  # the template died before prctl took effect
        os._exit(EXIT_PARENT_GONE)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request.stdout), (2, request.stderr)):
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(null)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    unbuffered = request.command.unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    # The template's streams own fds 0-2 (closefd): kept alive, or collecting them
    # would close the worker's.
    _KEPT.extend([sys.stdin, sys.stdout, sys.stderr])
    like_out, like_err = sys.__stdout__, sys.__stderr__
    streams = {
        "stdin": io.TextIOWrapper(io.FileIO(0, "r", closefd=False)),
        "stdout": _text_stream(1, unbuffered, like_out),
        "stderr": _text_stream(2, unbuffered, like_err),
    }
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    _follow_thread_settings()
    # A fresh interpreter seeds these from the OS; forks of one template would share them.
    random.seed()
    numpy_random = getattr(sys.modules.get("numpy"), "random", None)
    if numpy_random is not None and hasattr(numpy_random, "seed"):
        numpy_random.seed()


def _follow_thread_settings() -> None:
    """torch sized its intra-op thread pool (and OpenMP read ``OMP_NUM_THREADS``) when the
    template imported it, under the template's environment: give the worker the size its
    own ``OMP_NUM_THREADS`` asks for, as a fresh interpreter would have (4 workers of 2
    threads each on 2 cores spin against each other in every collective)."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and wanted.isdigit() and int(wanted) > 0:
        torch.set_num_threads(int(wanted))


def _text_stream(fd: int, unbuffered: bool, like: TextIO | None) -> io.TextIOWrapper:
    """A standard stream as the interpreter makes it (``-u``: no buffering), with the
    encoding and error handler of the template's own (``like``)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        binary,  # type: ignore[arg-type]
        encoding=like.encoding if like is not None else "utf-8",
        errors=like.errors if like is not None else "strict",
        line_buffering=fd == 2 and not unbuffered,
        write_through=unbuffered,
    )


def run_worker(command: WarmCommand) -> None:
    """Run the script or module as ``__main__``, as ``python`` would: ``sys.argv``,
    ``sys.path[0]``, the ``__main__`` module. Whatever ends it (an exception, a
    ``SystemExit``, a ``KeyboardInterrupt``) goes on up to the interpreter, which ends the
    process as ``python``'s does (:mod:`trainguard.agent.script_end`); its traceback is
    printed without this module's frames. The script's destroyed process groups are let
    go of first."""
    if command.module:
        sys.argv = ["-m", *command.args]
        sys.path[0] = os.getcwd()
        runner = _module_runner(command.target)
    else:
        path = command.target
        sys.argv = [path, *command.args]
        sys.path[0] = os.path.dirname(os.path.realpath(path))
        runner = _script_runner(path)
    keeper = GroupKeeper.install()
    try:
        runner()
    except BaseException:
        _hide_own_frames()
        raise
    finally:
        if keeper is not None:
            keeper.release()


def _hide_own_frames() -> None:
    """Have the traceback the interpreter prints for the exception now leaving the script
    start where ``python SCRIPT``'s would: after the frames of the template's own start
    (``runpy`` and this module), through whatever ``sys.excepthook`` is then."""
    hook = sys.excepthook

    def without_own_frames(
        kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
    ) -> None:
        start, walk = tb, tb
        while walk is not None:
            if walk.tb_frame.f_code.co_filename == __file__:
                start = walk.tb_next
            walk = walk.tb_next
        hook(kind, value.with_traceback(start), start)

    sys.excepthook = without_own_frames


def _script_runner(path: str) -> types.FunctionType:
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__cached__ = None  # type: ignore[attr-defined]
    sys.modules["__main__"] = main

    def run() -> None:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)

    return run  # type: ignore[return-value]


def _module_runner(name: str) -> types.FunctionType:
    import runpy

    def run() -> None:
        runpy._run_module_as_main(name, alter_argv=True)  # type: ignore[attr-defined]

    return run  # type: ignore[return-value]


# -- the template's loop -------------------------------------------------------------------


class Template:
    """Serves fork requests; reaps its workers and reports their exits."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self._buffer = b""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    def send(self, message: dict[str, object]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def serve(self) -> ForkRequest | None:
        """Until the agent hangs up: None. In a forked worker: its request."""
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self._wake_w)
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        while True:
            self._reap()
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is not self.sock:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 512):
                            pass  # SIGCHLD; reaped next turn
                    continue
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    return None
                self._buffer += chunk
                while b"\n" in self._buffer:
                    line, self._buffer = self._buffer.split(b"\n", 1)
                    request = self._fork(line)
                    if request is not None:  # the child
                        selector.close()
                        return request

    def _fork(self, line: bytes) -> ForkRequest | None:
        try:
            request = parse_request(line)
        except (ValueError, KeyError, TypeError) as exc:
            ident = _request_id(line)
            self.send({"forked": ident, "error": f"bad request: {exc}"})
            return None
        # The reply waits for the child to lead its session: a stop signals the group.
        set_up, done = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(set_up)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self.sock.close()
            try:
                become_worker(request, self.pid)
            except BaseException as exc:
                os.write(2, f"trainguard template: cannot start the worker: {exc}\n".encode())
                os._exit(EXIT_SETUP)
            os.close(done)
            return request
        os.close(done)
        with contextlib.suppress(OSError):
            os.read(set_up, 1)  # EOF: the child is set up, or gone
        os.close(set_up)
        self.send({"forked": request.id, "pid": pid})
        return None

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _request_id(line: bytes) -> int | None:
    try:
        ident = json.loads(line).get("fork")
    except (ValueError, AttributeError):
        return None
    return ident if isinstance(ident, int) else None


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: --parent-pid PID --fd FD [--preload MOD]... -- ARGV...", file=sys.stderr)
        return EXIT_USAGE
    split = argv.index("--")
    options, worker_argv = argv[:split], argv[split + 1 :]
    parent_pid, fd, extra = 0, -1, []
    it = iter(options)
    for option in it:
        value = next(it, "")
        if option == "--parent-pid" and value.isdigit():
            parent_pid = int(value)
        elif option == "--fd" and value.isdigit():
            fd = int(value)
        elif option == "--preload" and value:
            extra.append(value)
        else:
            print(f"bad option {option!r} {value!r}", file=sys.stderr)
            return EXIT_USAGE
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        return EXIT_PARENT_GONE
    sock = socket.socket(fileno=fd)
    template = Template(sock)
    command = warm_command(worker_argv)
    started = time.monotonic()
    if command is None:
        template.send({"ready": False, "why": f"not a Python command: {worker_argv[:3]!r}"})
        return 0
    sys.path[0] = (
        os.getcwd() if command.module else os.path.dirname(os.path.realpath(command.target))
    )
    preloaded = preload(command, extra)
    why = fork_unsafe_reason()
    if why is not None:
        template.send({"ready": False, "why": why})
        return 0
    # The workers forked from here share the preloaded modules' pages: frozen, a worker's
    # collector never walks those objects, so it neither spends its first collection on
    # them (0.1-1 s with torch and torch._dynamo) nor copies their pages by writing to
    # their headers (CPython's advice for a process that forks workers).
    gc.collect()
    gc.freeze()
    template.send(
        {"ready": True, "preloaded": preloaded, "seconds": round(time.monotonic() - started, 3)}
    )
    request = template.serve()
    if request is None:
        return 0
    run_worker(request.command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
