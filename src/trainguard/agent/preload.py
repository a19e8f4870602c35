"""What a worker template can run and what it imports before forking workers.

Pure reading, no side effects but the imports :func:`preload` is asked for; stdlib only
(it runs in the template, and :func:`warm_command` in the agent).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmCommand:
    """A worker argv that a template can run: ``python [-u] (SCRIPT | -m MODULE) ARGS``."""

    target: str  # the script's path, or the module's name
    module: bool
    args: tuple[str, ...]
    unbuffered: bool


def warm_command(argv: Sequence[str], python: str = sys.executable) -> WarmCommand | None:
    """What ``argv`` runs, when a template of interpreter ``python`` can run it; else None.

    Only this interpreter, with no options but ``-u``: any other flag (``-X``, ``-O``,
    ``-W``, ``-c``, ...) changes how an interpreter starts, which a fork cannot redo.
    """
    if len(argv) < 2:
        return None
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    if exe is None or os.path.realpath(exe) != os.path.realpath(python):
        return None
    rest = list(argv[1:])
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered = True
        rest.pop(0)
    if not rest:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return None
        return WarmCommand(rest[1], True, tuple(rest[2:]), unbuffered)
    if rest[0].startswith("-"):
        return None
    return WarmCommand(rest[0], False, tuple(rest[1:]), unbuffered)


# -- what to preload ---------------------------------------------------------------------


def imported_names(source: str) -> list[str]:
    """Modules the code imports anywhere, in order of appearance: ``import a.b`` -> ``a.b``,
    ``from a.b import c`` -> ``a.b`` and ``a.b.c`` (``c`` may be a submodule; a name that
    is not fails to import, which is skipped). Relative imports name no package."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module, *(f"{node.module}.{a.name}" for a in node.names if a.name != "*")]
        else:
            continue
        for name in found:
            if name not in names:
                names.append(name)
    return names


def installed_modules(names: Sequence[str], local_dirs: Sequence[str]) -> list[str]:
    """The names whose top-level package is installed or in the standard library, not the
    user's own beside the script (those may read the rank's environment when imported)."""
    local = [os.path.realpath(d) for d in local_dirs]
    verdicts: dict[str, bool] = {}
    out: list[str] = []
    for name in names:
        top = name.split(".")[0]
        if top == "__main__":
            continue
        if top not in verdicts:
            verdicts[top] = _installed(top, local)
        if verdicts[top]:
            out.append(name)
    return out


def _installed(top: str, local: Sequence[str]) -> bool:
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    origin = spec.origin or (list(spec.submodule_search_locations or []) or [""])[0]
    if origin in ("built-in", "frozen") or not origin:
        return True
    path = os.path.realpath(origin)
    return not any(path == d or path.startswith(d + os.sep) for d in local if d)


def script_source(command: WarmCommand) -> tuple[str, list[str]]:
    """The worker's main source and the directories of the user's own modules."""
    if command.module:
        try:
            spec = importlib.util.find_spec(command.target)
        except (ImportError, ValueError):
            return "", [os.getcwd()]
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            return "", [os.getcwd()]
        path = spec.origin
        local = [os.getcwd()]
    else:
        path = command.target
        local = [os.path.dirname(os.path.realpath(path))]
    try:
        with io.open_code(path) as f:
            return f.read().decode("utf-8", errors="replace"), local
    except OSError:
        return "", local


LAZY_IMPORTS = {"torch": ("torch._dynamo",)}
"""Modules a package imports on first use, not at import: with torch, ``torch._dynamo``
(and ~900 modules, sympy among them), which the first optimizer a script builds imports:
1 s per worker here, 3.7 s for 6 workers starting at once on 2 cores."""


def preload(command: WarmCommand, extra: Sequence[str]) -> list[str]:
    """Import what the worker will: the installed modules its script imports, what those
    import on first use (:data:`LAZY_IMPORTS`), and ``extra``; returns what was imported.
    A module that fails to import is skipped (the worker will meet that error itself, in
    its own log)."""
    source, local = script_source(command)
    names = installed_modules(imported_names(source), local)
    tops = {name.split(".")[0] for name in [*extra, *names]}
    lazy = [m for top in sorted(tops) for m in LAZY_IMPORTS.get(top, ())]
    done: list[str] = []
    for name in [*extra, *names, *lazy]:
        if name in done:
            continue
        try:
            importlib.import_module(name)
        except BaseException:
            continue
        done.append(name)
    return done


def fork_unsafe_reason() -> str | None:
    """Why forking workers from this process would not be safe, or None."""
    # Native pools (OpenBLAS's, started by importing numpy) handle fork themselves, as
    # they must for DataLoader workers; a Python thread holding a lock would not.
    if threading.active_count() > 1:
        names = [t.name for t in threading.enumerate()]
        return f"Python threads running after preloading: {names} (a fork copies only one)"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "CUDA was initialised while preloading"
    return None
