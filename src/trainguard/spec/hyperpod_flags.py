"""hyperpodrun's own flags, honoured as ``spec.trainguard`` options.

HyperPod's ``hyperpodrun`` is torchrun's parser plus a few flags of its own (see
``REFERENCE.md``). trainguard takes them in a launcher line of a spec's command and as
``trainguard run`` flags, and maps each onto an option it already has:

| hyperpodrun | ``spec.trainguard`` |
| --- | --- |
| ``--pre-train-script S --pre-train-args A`` | ``preTrainScript: [S, *shlex.split(A)]`` |
| ``--post-train-script S --post-train-args A`` | ``postTrainScript: [S, *shlex.split(A)]`` |
| ``--shutdown-signal SIGTERM\\|SIGKILL`` | ``shutdownSignal`` |
| ``--shutdown-timeout T`` | ``stopGracePeriodSeconds: T`` |
| ``--inprocess-restart`` | ``inProcessRestart: true`` |
| ``--inprocess-timeout T`` | ``restartBarrierTimeoutSeconds: T`` |

``--shutdown-signal`` applies to every stop, a fault's restart included (SIGTERM: then
SIGKILL after the grace; SIGKILL: at once). A flag left out leaves the option as the spec
has it; without ``shutdownSignal`` trainguard keeps its own behaviour (a requested stop is
SIGTERM then SIGKILL after ``stopGracePeriodSeconds``, a fault's restart SIGKILL at once),
not hyperpodrun's default (SIGKILL for every stop). A flag that disagrees with the spec's
field, or with another group's launcher line, is a spec error.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from trainguard.spec.load import SpecError, problems_of
from trainguard.spec.model import TrainguardOptions, TrainingJob

__all__ = ["HyperpodFlags", "add_hyperpod_flags", "hyperpod_flags", "with_hyperpod_flags"]

SHUTDOWN_SIGNALS = ("SIGTERM", "SIGKILL")
_PREFIX = "hyperpod:"
# Each flag: how ``trainguard run`` takes it (argparse's keywords) and its help there. A
# launcher line takes it spelt either way (--pre-train-script, --pre_train_script).
_FLAGS: tuple[tuple[str, dict[str, Any], str], ...] = (
    (
        "--pre-train-script",
        {"metavar": "SCRIPT"},
        "run on every node before its workers start; its failure is a fault",
    ),
    (
        "--pre-train-args",
        {"metavar": "ARGS"},
        "the pre-train script's arguments, one string split as a shell would",
    ),
    (
        "--post-train-script",
        {"metavar": "SCRIPT"},
        "run on every node once its workers all exited 0; its failure is a fault",
    ),
    (
        "--post-train-args",
        {"metavar": "ARGS"},
        "the post-train script's arguments, one string split as a shell would",
    ),
    (
        "--shutdown-signal",
        {"choices": SHUTDOWN_SIGNALS},
        "the signal that stops workers (default SIGTERM, then SIGKILL after the timeout; "
        "hyperpodrun's default is SIGKILL)",
    ),
    (
        "--shutdown-timeout",
        {"metavar": "SECONDS"},
        "after SIGTERM, SIGKILL follows this long later (spec.trainguard.stopGracePeriodSeconds)",
    ),
    (
        "--inprocess-restart",
        {"action": "store_true"},
        "restart in-process after a worker crash (spec.trainguard.inProcessRestart)",
    ),
    (
        "--inprocess-timeout",
        {"metavar": "SECONDS"},
        "how long every rank has to rejoin an in-process restart "
        "(spec.trainguard.restartBarrierTimeoutSeconds)",
    ),
)
# option (field name) -> the flag that sets it, for messages
FLAG_OF_OPTION = {
    "pre_train_script": "--pre-train-script",
    "post_train_script": "--post-train-script",
    "shutdown_signal": "--shutdown-signal",
    "stop_grace_period_seconds": "--shutdown-timeout",
    "in_process_restart": "--inprocess-restart",
    "restart_barrier_timeout_seconds": "--inprocess-timeout",
}


@dataclass(frozen=True)
class HyperpodFlags:
    """The hyperpodrun flags a launcher line (or ``trainguard run``) gave; None: not given."""

    pre_train: tuple[str, ...] | None = None
    post_train: tuple[str, ...] | None = None
    shutdown_signal: str | None = None
    shutdown_timeout: float | None = None
    inprocess_restart: bool = False
    inprocess_timeout: float | None = None

    def options(self) -> dict[str, Any]:
        """The ``spec.trainguard`` fields these flags set (field name -> value)."""
        given: dict[str, Any] = {
            "pre_train_script": list(self.pre_train) if self.pre_train else None,
            "post_train_script": list(self.post_train) if self.post_train else None,
            "shutdown_signal": self.shutdown_signal,
            "stop_grace_period_seconds": self.shutdown_timeout,
            "in_process_restart": True if self.inprocess_restart else None,
            "restart_barrier_timeout_seconds": self.inprocess_timeout,
        }
        return {name: value for name, value in given.items() if value is not None}


def add_hyperpod_flags(parser: argparse.ArgumentParser) -> None:
    """Add hyperpodrun's flags to a launcher-line parser (values land under ``hyperpod:``)."""
    for flag, how, _ in _FLAGS:
        action = how.get("action", "store")  # any value: make_flags checks it
        parser.add_argument(
            flag, "--" + flag[2:].replace("-", "_"), dest=_PREFIX + flag, action=action
        )


def add_hyperpodrun_flags(parser: argparse.ArgumentParser) -> None:
    """``trainguard run``'s hyperpodrun flags (the torchrun-style form), in a group."""
    group = parser.add_argument_group("hyperpodrun's flags (the torchrun-style form)")
    for flag, how, help_text in _FLAGS:
        group.add_argument(flag, help=help_text, **how)


def flags_of_args(args: argparse.Namespace) -> HyperpodFlags:
    """The hyperpodrun flags ``trainguard run`` was given; ValueError if bad."""
    return make_flags(lambda flag: getattr(args, flag[2:].replace("-", "_")))


def hyperpod_flags(ns: Mapping[str, Any]) -> HyperpodFlags:
    """The flags in a parsed launcher line (``add_hyperpod_flags``'s); ValueError if bad."""
    given = {key[len(_PREFIX) :]: value for key, value in ns.items() if key.startswith(_PREFIX)}
    return make_flags(given.get) if given else HyperpodFlags()


def make_flags(value: Callable[[str], Any]) -> HyperpodFlags:
    """Check and combine the flags' raw values (``value(flag)``: None when not given);
    ValueError naming the flag if bad."""
    shutdown_signal = value("--shutdown-signal")
    if shutdown_signal is not None and shutdown_signal not in SHUTDOWN_SIGNALS:
        raise ValueError(f"--shutdown-signal={shutdown_signal}: expected SIGTERM or SIGKILL")
    return HyperpodFlags(
        pre_train=_script("--pre-train", value("--pre-train-script"), value("--pre-train-args")),
        post_train=_script(
            "--post-train", value("--post-train-script"), value("--post-train-args")
        ),
        shutdown_signal=shutdown_signal,
        shutdown_timeout=_seconds("--shutdown-timeout", value("--shutdown-timeout")),
        inprocess_restart=bool(value("--inprocess-restart")),
        inprocess_timeout=_seconds("--inprocess-timeout", value("--inprocess-timeout")),
    )


def _script(flag: str, script: str | None, args: str | None) -> tuple[str, ...] | None:
    if script is None:
        if args is not None:
            raise ValueError(f"{flag}-args needs {flag}-script")
        return None
    if not script:
        raise ValueError(f"{flag}-script: empty")
    try:
        words = shlex.split(args) if args else []
    except ValueError as err:
        raise ValueError(f"{flag}-args={args!r}: {err}") from None
    return (script, *words)


def _seconds(flag: str, value: str | float | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{flag}={value}: expected a number of seconds") from None


def with_hyperpod_flags(
    job: TrainingJob, given: Sequence[tuple[str, HyperpodFlags]], source: str
) -> TrainingJob:
    """``job`` with the options the flags set (``given``: where each set came from, e.g. a
    launcher line's place in the spec); SpecError when they disagree with the spec's
    fields or with each other, or are out of range."""
    options = job.spec.trainguard
    written = options.model_fields_set
    updates: dict[str, Any] = {}
    origin: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    for where, flags in given:
        for name, value in flags.options().items():
            flag = FLAG_OF_OPTION[name]
            if name in written and getattr(options, name) != value:
                problems.append((where, f"{flag} disagrees with spec.trainguard's {name}"))
            elif name in updates and updates[name] != value:
                problems.append((where, f"{flag} disagrees with {flag} in {origin[name]}"))
            else:
                updates[name] = value
                origin[name] = where
    if problems:
        raise SpecError(source, problems)
    if not updates:
        return job
    try:
        new = TrainguardOptions.model_validate({**options.model_dump(), **updates})
    except ValidationError as err:
        raise SpecError(
            source,
            [
                (origin.get(path, source), f"{FLAG_OF_OPTION.get(path, path)}: {message}")
                for path, message in _field_problems(err)
            ],
        ) from None
    spec = job.spec.model_copy(update={"trainguard": new})
    return job.model_copy(update={"spec": spec})


def _field_problems(err: ValidationError) -> list[tuple[str, str]]:
    """(field name, message) per problem of a TrainguardOptions validation."""
    from pydantic.alias_generators import to_snake

    return [(to_snake(path.split(".")[0]), message) for path, message in problems_of(err)]
