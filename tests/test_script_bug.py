"""The script-bug rule (control/script_bug.py): literal faults in, a verdict out."""

from __future__ import annotations

from typing import Any

import pytest

from trainguard.control.events import Fault, FaultType
from trainguard.control.script_bug import ScriptBug, script_bug

ERROR = "ValueError: mesh (2, 3) does not fit 4 ranks"
TRACE = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: mesh'


def crash(rank: int, attempt: int, *, step: int | None = None, **evidence: Any) -> Fault:
    evidence = {"exitcode": 1, "error": ERROR, **evidence}
    message = f"rank {rank} exited with exit code {evidence['exitcode']}: {evidence['error']}"
    return Fault(
        FaultType.WORKER_CRASH, 10.0 + attempt, attempt, "node-0", rank, step, message, evidence
    )


def test_the_first_attempt_with_the_error_is_retried() -> None:
    assert script_bug([[crash(0, 0), crash(1, 0)]], stepped=False, world_size=4) is None


def test_the_same_error_in_the_retry_fails_the_job_with_a_traceback() -> None:
    attempts = [[crash(1, 0, traceback=TRACE)], [crash(0, 1), crash(2, 1), crash(3, 1)]]
    assert script_bug(attempts, stepped=False, world_size=4) == ScriptBug(
        ERROR, (0, 1, 2, 3), TRACE
    )


@pytest.mark.parametrize(
    ("last", "stepped"),
    [
        ([crash(0, 1, error="KeyError: 'lr'")], False),  # another error
        ([crash(0, 1), crash(1, 1, error="KeyError: 'lr'")], False),  # ranks disagree
        ([crash(0, 1, step=3)], False),  # a step was seen before it
        ([crash(0, 1)], True),  # the job stepped in an earlier attempt
        ([crash(0, 1, exitcode=-9, error=None)], False),  # a kill, no error
        ([crash(0, 1, exitcode=75)], False),  # gave up a restart barrier
        ([crash(0, 1, exitcode=70)], False),  # a broken CUDA context
        ([crash(0, 1, error="")], False),  # no error to compare
        ([crash(0, 1), Fault(FaultType.NODE_LOST, 11.0, 1, "node-1")], False),
        ([], False),
    ],
)
def test_anything_else_is_retried_as_usual(last: list[Fault], stepped: bool) -> None:
    assert script_bug([[crash(0, 0)], last], stepped=stepped, world_size=1) is None


@pytest.mark.parametrize(
    "error",
    [
        "torch.distributed.DistNetworkError: failed to connect to the store",
        "ConnectionRefusedError: [Errno 111] Connection refused",
        "TimeoutError: timed out",
        "RuntimeError: NCCL error in: init.cc:1, unhandled system error",
        "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
    ],
)
def test_the_machines_errors_are_never_a_script_bug(error: str) -> None:
    """A peer or store gone: the same line on every rank, attempt after attempt."""
    attempts = [[crash(0, 0, error=error), crash(1, 0, error=error)], [crash(2, 1, error=error)]]
    assert script_bug(attempts, stepped=False, world_size=4) is None


def test_only_the_last_two_attempts_count() -> None:
    other = [crash(0, 0, error="OSError: disk full")]
    assert script_bug([other, [crash(0, 1)]], stepped=False, world_size=4) is None
    assert script_bug([other, [crash(0, 1)], [crash(1, 2)]], stepped=False, world_size=2)


def test_two_ranks_with_the_same_error_are_enough() -> None:
    """An in-process restart is decided on the first crash: the ranks' crashes arrive one
    or two an attempt."""
    assert script_bug([[crash(2, 0)], [crash(0, 1)]], stepped=False, world_size=4)
    assert script_bug([[crash(0, 0)], [crash(0, 1)]], stepped=False, world_size=1)


def test_a_rank_that_did_not_fail_makes_it_no_script_bug() -> None:
    """One rank's error (its data, its node) on every attempt: retried as usual."""
    assert script_bug([[crash(1, 0)], [crash(1, 1)]], stepped=False, world_size=2) is None


def test_the_reason_names_the_error_and_the_ranks() -> None:
    reason = ScriptBug(ERROR, (0, 1), None).reason
    assert ERROR in reason and "ranks 0, 1" in reason and "not retried" in reason
