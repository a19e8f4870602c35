"""Exec shim between the agent and a worker: ties the worker's life to the agent's.

torch starts every worker in its own session, so killing the agent's process
group does not reach them. This shim, run as the worker entry point, asks the
kernel to SIGKILL it when its parent (the agent thread that forked it) dies,
then ``execvp``\\ s the user's command: the worker keeps the shim's pid and the
death signal, and is exactly the user's command.

    python -m trainguard.agent.exec_worker --parent-pid PID [--cwd DIR] -- ARGV...

Keep it tiny: stdlib only, no torch, no other trainguard module.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
EXIT_PARENT_GONE = 1
EXIT_USAGE = 2
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent thread exits.

    Returns False where ``prctl`` does not exist (not Linux); raises ``OSError``
    if it exists and fails.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except AttributeError:
        return False
    if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    return True


def _fail(code: int, message: str) -> int:
    sys.stderr.write(f"trainguard exec_worker: {message}\n")
    sys.stderr.flush()
    return code


def main(argv: list[str]) -> int:
    if "--" not in argv:
        return _fail(EXIT_USAGE, "usage: --parent-pid PID [--cwd DIR] -- ARGV...")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    parent_pid: int | None = None
    cwd: str | None = None
    it = iter(options)
    for option in it:
        value = next(it, None)
        if option == "--parent-pid" and value is not None and value.isdigit():
            parent_pid = int(value)
        elif option == "--cwd" and value:
            cwd = value
        else:
            return _fail(EXIT_USAGE, f"bad option {option!r} {value!r}")
    if parent_pid is None or not command:
        return _fail(EXIT_USAGE, "need --parent-pid PID and a command after --")

    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        return _fail(EXIT_PARENT_GONE, f"agent {parent_pid} is gone; not starting {command[0]}")
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError as exc:
            return _fail(EXIT_CANNOT_EXECUTE, f"cannot enter working directory {cwd!r}: {exc}")
    # Python ignores SIGPIPE/SIGXFSZ and ignored signals survive exec; give the
    # user's command the default dispositions, as subprocess does.
    for name in ("SIGPIPE", "SIGXFZ", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        return _fail(EXIT_NOT_FOUND, f"command not found: {command[0]!r}")
    except OSError as exc:
        return _fail(EXIT_CANNOT_EXECUTE, f"cannot execute {command[0]!r}: {exc.strerror}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
