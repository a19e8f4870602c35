"""Recognise launcher lines (torchrun, hyperpodrun, python -m torch.distributed.run).

A container command in a job spec is often a launcher line written for torchrun or
HyperPod's `hyperpodrun`. trainguard is its own launcher: it keeps the script and the
node/process counts and drops the launcher. Flags the controller decides itself
(rendezvous, master address, node rank, logging, ...) are reported in `ignored`.

Own argparse parser with torchrun's flag names rather than torchrun's real one: the real
one reads defaults from PET_* environment variables, cannot tell "not given" from its
defaults, exits the process on error and would import torch.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from trainguard.spec.hyperpod_flags import HyperpodFlags, add_hyperpod_flags, hyperpod_flags
from trainguard.spec.limits import MAX_NODES, MAX_NPROC_PER_NODE, MAX_RESTARTS

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_TORCHRUN_MODULE = "torch.distributed.run"
# Interpreter flags without a value that may precede `-m torch.distributed.run`.
_PYTHON_FLAGS = frozenset({"-u", "-B", "-E", "-I", "-O", "-OO", "-s", "-S", "-q", "-b", "-bb"})
_NPROC = re.compile(r"^(auto|cpu|gpu|[1-9][0-9]*)$")


class LauncherError(ValueError):
    """A launcher line that cannot be honoured (bad flag, MIN != MAX nodes, ...)."""


@dataclass(frozen=True)
class LauncherLine:
    """What trainguard keeps from a launcher line."""

    nnodes: int | None
    nproc_per_node: str | None
    max_restarts: int | None
    module: bool
    no_python: bool
    script: str
    script_args: tuple[str, ...]
    ignored: tuple[str, ...]  # flags given that trainguard overrides, e.g. "--master-port"
    launcher: str  # "torchrun" | "hyperpodrun" | "python3 -m torch.distributed.run"
    # hyperpodrun's own flags trainguard honours (see trainguard.spec.hyperpod_flags).
    hyperpod: HyperpodFlags = field(default_factory=lambda: HyperpodFlags())


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if "training_script" in message:
            message = "missing the training script"
        raise LauncherError(message)


# (flag spellings, takes a value) for flags trainguard does not use.
_TORCHRUN_IGNORED: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("--rdzv-backend", "--rdzv_backend"), True),
    (("--rdzv-endpoint", "--rdzv_endpoint"), True),
    (("--rdzv-id", "--rdzv_id"), True),
    (("--rdzv-conf", "--rdzv_conf"), True),
    (("--standalone",), False),
    (("--monitor-interval", "--monitor_interval"), True),
    (("--start-method", "--start_method"), True),
    (("--event-log-handler", "--event_log_handler"), True),
    (("--role",), True),
    (("--run-path", "--run_path"), False),
    (("--log-dir", "--log_dir"), True),
    (("-r", "--redirects"), True),
    (("-t", "--tee"), True),
    (("--local-ranks-filter", "--local_ranks_filter"), True),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), True),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), True),
    (("--node-rank", "--node_rank"), True),
    (("--master-addr", "--master_addr"), True),
    (("--master-port", "--master_port"), True),
    (("--local-addr", "--local_addr"), True),
    (("--logs-specs", "--logs_specs"), True),
    (("--numa-binding", "--numa_binding"), True),
    (("--signals-to-handle", "--signals_to_handle"), True),
    (("--shutdown-timeout", "--shutdown_timeout"), True),
    (("--virtual-local-rank", "--virtual_local_rank"), False),
)
_HYPERPODRUN_IGNORED: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("--server-host", "--server_host"), True),
    (("--server-port", "--server_port"), True),
    (("--server-log-level", "--server_log_level"), True),
    (("--server-shutdown-timeout", "--server_shutdown_timeout"), True),
)


def _build_parser(hyperpod: bool) -> _Parser:
    parser = _Parser(
        prog="hyperpodrun" if hyperpod else "torchrun",
        add_help=False,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,  # absent flags stay absent
    )
    parser.add_argument("--nnodes")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts")
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("--no-python", "--no_python", dest="no_python", action="store_true")
    ignored = _TORCHRUN_IGNORED + (_HYPERPODRUN_IGNORED if hyperpod else ())
    if hyperpod:  # hyperpodrun's --shutdown-timeout is its own, not torchrun's (ignored)
        ignored = tuple(item for item in ignored if item[0][0] != "--shutdown-timeout")
        add_hyperpod_flags(parser)
    for spellings, takes_value in ignored:
        long_name = next(s for s in spellings if s.startswith("--"))
        dest = "ignored:" + long_name.replace("_", "-")
        if takes_value:
            parser.add_argument(*spellings, dest=dest)
        else:
            parser.add_argument(*spellings, dest=dest, action="store_true")
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _launcher_of(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """(launcher name, launcher arguments) if argv starts with a launcher, else None."""
    if not argv:
        return None
    program = os.path.basename(argv[0])
    if program in ("torchrun", "hyperpodrun"):
        return program, list(argv[1:])
    if not _PYTHON.match(program):
        return None
    i = 1
    while i < len(argv) and argv[i] in _PYTHON_FLAGS:
        i += 1
    if i < len(argv) and argv[i] == "-m" and i + 1 < len(argv):
        module, rest = argv[i + 1], argv[i + 2 :]
    elif i < len(argv) and argv[i].startswith("-m") and len(argv[i]) > 2:
        module, rest = argv[i][2:], argv[i + 1 :]
    else:
        return None
    if module != _TORCHRUN_MODULE:
        return None
    return f"{program} -m {_TORCHRUN_MODULE}", list(rest)


def parse_nnodes(value: str) -> int:
    """torchrun's --nnodes: "N" or "MIN:MAX" with MIN == MAX (no elastic ranges)."""
    parts = value.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        raise LauncherError(f"--nnodes={value}: expected N or MIN:MAX") from None
    if len(numbers) not in (1, 2) or any(n < 1 for n in numbers):
        raise LauncherError(f"--nnodes={value}: expected N or MIN:MAX with N >= 1")
    if numbers[0] != numbers[-1]:
        raise LauncherError(
            f"--nnodes={value}: MIN must equal MAX (use spec.elasticPolicy for elastic jobs)"
        )
    if numbers[0] > MAX_NODES:
        raise LauncherError(f"--nnodes={value}: at most {MAX_NODES}")
    return numbers[0]


def parse_launcher(argv: Sequence[str]) -> LauncherLine | None:
    """Parse argv if it is a launcher line; None when it is not. Raises LauncherError."""
    found = _launcher_of(argv)
    if found is None:
        return None
    launcher, rest = found
    try:
        ns = vars(_build_parser(hyperpod=launcher == "hyperpodrun").parse_args(rest))
    except LauncherError as err:
        raise LauncherError(f"{launcher}: {err}") from None
    nnodes = parse_nnodes(ns["nnodes"]) if "nnodes" in ns else None
    nproc = ns.get("nproc_per_node")
    if nproc is not None and not _NPROC.match(nproc):
        raise LauncherError(
            f"--nproc-per-node={nproc}: expected auto, cpu, gpu or a positive integer"
        )
    if (
        nproc is not None
        and nproc.isdigit()
        and (len(nproc) > 9 or int(nproc) > MAX_NPROC_PER_NODE)
    ):
        raise LauncherError(f"--nproc-per-node={nproc}: at most {MAX_NPROC_PER_NODE}")
    max_restarts: int | None = None
    if "max_restarts" in ns:
        try:
            max_restarts = int(ns["max_restarts"])
        except ValueError:
            max_restarts = -1
        if max_restarts < 0:
            raise LauncherError(f"--max-restarts={ns['max_restarts']}: expected an integer >= 0")
        if max_restarts > MAX_RESTARTS:
            raise LauncherError(f"--max-restarts={max_restarts}: at most {MAX_RESTARTS}")
    module = bool(ns.get("module", False))
    no_python = bool(ns.get("no_python", False))
    run_path = bool(ns.get("ignored:--run-path", False))
    if module and no_python:
        raise LauncherError(f"{launcher}: --no-python and -m/--module cannot be used together")
    try:
        hyperpod = hyperpod_flags(ns)
    except ValueError as err:
        raise LauncherError(f"{launcher}: {err}") from None
    return LauncherLine(
        launcher=launcher,
        nnodes=nnodes,
        nproc_per_node=nproc,
        max_restarts=max_restarts,
        module=module,
        no_python=no_python and not run_path,  # torchrun: --run-path wins over --no-python
        script=ns["training_script"],
        script_args=tuple(ns.get("training_script_args", ())),
        ignored=tuple(key.split(":", 1)[1] for key in ns if key.startswith("ignored:")),
        hyperpod=hyperpod,
    )
