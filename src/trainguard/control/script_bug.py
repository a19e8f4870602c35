"""A script bug: the same error from the ranks that failed, before any step, twice.

An error that a script raises the same way on every rank before its first step (a wrong
argument, a missing file, a model that does not fit its mesh) comes back on every
restart; retrying it in place only burns the retry budget, a second a try. The rule
(:func:`script_bug`, pure): the job retries such a crash once, whatever the scope, and
when the retry ends the same way the job fails with the error and its traceback, which
``trainguard describe`` shows.

"The same way": every fault of the two attempts is a worker crash of a rank that exited
with a code (not a signal, not a resilient worker's barrier exit) and left an error (the
exception line its error file or its stderr gave), they all left the same one, more than
one rank left it (the one rank of a one-rank job), and no step of the job was seen before
them (no fault carries a step, and no attempt reported progress). "Every rank" cannot be
waited for: an in-process restart is decided on the first crash, and the other ranks'
crashes arrive one by one in the next attempts; the same error from two ranks is what
tells the script's error from one rank's (its data, its node), which is retried as usual,
as is a job with a fault of another kind, a kill, or a step in between. An error of the
machines rather than the script (torch.distributed's ``Dist*Error``, a connection or
timeout error, one that names NCCL or gloo: a peer or a store that went away) is never
a script bug.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.control.events import Fault, FaultType
from trainguard.wire.control_files import EXIT_BARRIER_TIMEOUT

__all__ = ["EXIT_RESERVED", "ScriptBug", "script_bug"]

_NOT_THE_SCRIPT = re.compile(
    r"^(?:[\w.]*\.)?(?:Dist\w*Error|Connection\w*Error|BrokenPipeError|\w*Timeout\w*)\b"
    r"|NCCL|[Gg]loo"
)
"""Error lines that are the machines' (a peer or store gone), not the script's."""
EXIT_CUDA_UNHEALTHY = 70  # trainguard.resilient.cuda_check's (that module imports torch)
EXIT_RESERVED = frozenset({EXIT_BARRIER_TIMEOUT, EXIT_CUDA_UNHEALTHY})
"""Exit codes that are trainguard's, not the script's: a resilient worker that gave up a
restart barrier or found its CUDA context broken."""


@dataclass(frozen=True)
class ScriptBug:
    """Why the job fails: the error every failing rank raised, and one traceback of it."""

    error: str
    ranks: tuple[int, ...]
    traceback: str | None

    @property
    def reason(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        return (
            f"script error before the first step, the same on every failing rank (ranks "
            f"{ranks}) in two attempts in a row, so not retried again: {self.error}"
        )


def script_bug(
    attempts: Sequence[Sequence[Fault]], stepped: bool, world_size: int
) -> ScriptBug | None:
    """Whether the job's ended attempts (their faults, oldest first) end in a script bug.

    ``stepped``: whether any attempt of the job reported a step; ``world_size``: the
    job's ranks. A verdict needs the last two attempts to have ended with the same script
    error from more than one rank (see the module doc): the first of them is retried,
    the second is not.
    """
    if stepped or len(attempts) < 2:
        return None
    last, before = _same_error(attempts[-1]), _same_error(attempts[-2])
    if last is None or before is None or last != before:
        return None
    faults = [*attempts[-2], *attempts[-1]]
    traceback = next(
        (t for f in reversed(faults) if isinstance(t := f.evidence.get("traceback"), str) and t),
        None,
    )
    ranks = tuple(sorted({f.rank for f in faults if f.rank is not None}))
    if len(ranks) < min(2, world_size):
        return None
    return ScriptBug(last, ranks, traceback)


def _same_error(faults: Sequence[Fault]) -> str | None:
    """The one error every fault of an attempt is a script crash with, else None."""
    errors = {_script_error(f) for f in faults}
    if len(errors) != 1:
        return None
    return errors.pop()


def _script_error(fault: Fault) -> str | None:
    code = fault.evidence.get("exitcode")
    error = fault.evidence.get("error")
    if (
        fault.type is not FaultType.WORKER_CRASH
        or fault.rank is None
        or fault.step is not None
        or not isinstance(code, int)
        or code <= 0
        or code in EXIT_RESERVED
        or not isinstance(error, str)
        or not error
        or _NOT_THE_SCRIPT.search(error)
    ):
        return None
    return error
