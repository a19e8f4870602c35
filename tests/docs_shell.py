"""Checking the docs' shell blocks without running them.

Each command line of a block (continuations joined, ``$ `` prompts of a ``console``
block only) is split into simple commands (at ``|``, ``&&``, ``||``, ``;``, ``&``), and:

- ``trainguard`` (or ``.venv/bin/trainguard``): parsed by trainguard's own argparse
  parser, never run; each ``--inject`` SPEC parsed by the injector's parser; the files
  it names (``-f``, the script, ``--env-file``) must exist in the repository, or be a
  reader's own file from ``PLACEHOLDER_FILES``;
- ``make``: the target must be in the Makefile; ``BENCH_ARGS`` parsed by the benchmark's
  parser;
- ``python -m bench ...``: parsed by the benchmark's parser; ``python -m X``: X importable;
- every command: a word that starts with a folder of the repository (``examples/``,
  ``tests/``...) names a path that must exist.

A usage-style optional group, `` [-o json]``, is checked both without and with it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard.cli import _parser, parse_command_line
from trainguard.platform.inject import parse_injection

REPO = Path(__file__).resolve().parent.parent

# Files a command may name that are the reader's own, not the repository's.
PLACEHOLDER_FILES = {
    "job.yaml": "the reader's job spec",
    "train.py": "the reader's training script",
    "train_elastic.py": "the script shown on the page, saved by the reader",
    "secrets.env": "the reader's secrets file",
    "...": "the rest of the command, elided",
}
_REPO_DIRS = ("bench/", "deploy/", "docs/", "examples/", "src/", "tests/")
_OPERATORS = {"|", "||", "&&", ";", "&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "2>", "2>&1"}
_OPTIONAL_GROUP = re.compile(r"(?<=\s)\[([^\[\]]+)\]")


def command_lines(code: str, console: bool) -> list[str]:
    """The block's command lines, continuations joined (for console: the ``$ `` lines)."""
    lines: list[str] = []
    pending = ""
    for raw in code.splitlines():
        if console and not pending:
            if not raw.startswith("$ "):
                continue  # output
            raw = raw[2:]
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    if pending:
        lines.append(pending)
    return lines


def variants(line: str) -> list[str]:
    """The line without its ``[optional]`` groups, and with them (brackets dropped)."""
    if not _OPTIONAL_GROUP.search(line):
        return [line]
    return [_OPTIONAL_GROUP.sub("", line), _OPTIONAL_GROUP.sub(r"\1", line)]


def simple_commands(line: str) -> Iterator[list[str]]:
    """The words of each simple command of a line, without assignments and redirections."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    skip_next = False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in _OPERATORS:
            if words:
                yield words
            words = []
        elif token in _REDIRECTS or set(token) <= set("<>&"):
            skip_next = token in {">", ">>", "<"}
        elif not words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token):
            continue  # VAR=value before the command
        else:
            words.append(token)
    if words:
        yield words


def problems(words: list[str]) -> list[str]:
    """What is wrong with one simple command (empty: nothing)."""
    found = [f"{word}: no such path in the repository" for word in words if _missing_path(word)]
    program = Path(words[0]).name
    if program == "trainguard":
        found += _trainguard(words[1:])
    elif program == "make":
        found += _make(words[1:])
    elif program in ("python", "python3") and words[1:2] == ["-m"] and len(words) > 2:
        found += _python_module(words[2], words[3:])
    return found


def _missing_path(word: str) -> bool:
    if not word.startswith(_REPO_DIRS):
        return False
    path = word.split("=", 1)[-1].split(":", 1)[0].rstrip("/")  # a --flag=PATH's PATH
    return not (REPO / path).exists()


def _trainguard(argv: list[str]) -> list[str]:
    args, error = parse(_parser(), argv, trainguard=True)
    if args is None:
        return [f"trainguard {shlex.join(argv)}: refused by trainguard's parser: {error}"]
    found = []
    for spec in getattr(args, "inject", []) or []:
        try:
            parse_injection(spec)
        except ValueError as exc:
            found.append(f"--inject {spec}: {exc}")
    files = [getattr(args, "file", None), *(getattr(args, "env_file", None) or [])]
    if args.verb == "run" and not (args.module or args.no_python):
        files.append(args.script)
    for name in filter(None, files):
        if name.startswith(("/", "~", "$")) or name in PLACEHOLDER_FILES:
            continue
        if not (REPO / name).exists():
            found.append(f"{name}: not in the repository, nor a reader's file (PLACEHOLDER_FILES)")
    return found


def parse(
    parser: argparse.ArgumentParser, argv: list[str], trainguard: bool = False
) -> tuple[Any, str]:
    """``parser.parse_args(argv)`` without exiting: (namespace, "") or (None, its error);
    ``trainguard``: as trainguard's CLI parses its command line (sbatch's options)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            if trainguard:
                return parse_command_line(parser, argv), ""
            return parser.parse_args(argv), ""
        except SystemExit:
            lines = stderr.getvalue().strip().splitlines()
            return None, lines[-1] if lines else "exited"


def _make(argv: list[str]) -> list[str]:
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    found = []
    for word in argv:
        name, eq, value = word.partition("=")
        if eq and name == "BENCH_ARGS":
            found += _bench(shlex.split(value))
        elif not eq and not word.startswith("-") and word not in targets:
            found.append(f"make {word}: no such target in the Makefile")
    return found


def _python_module(module: str, argv: list[str]) -> list[str]:
    if str(REPO) not in sys.path:  # bench/ lives at the top of the repository
        sys.path.insert(0, str(REPO))
    if module == "bench":
        return _bench(argv)
    if importlib.util.find_spec(module) is None:
        return [f"python -m {module}: no such module"]
    return []


def _bench(argv: list[str]) -> list[str]:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench.__main__ import parse_args

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parse_args(argv)
        except SystemExit:
            return [
                f"python -m bench {shlex.join(argv)}: {stderr.getvalue().strip().splitlines()[-1]}"
            ]
    return []
