"""Running on-start checks: each bounded by its timeout, forced failures for rehearsals.

A check is any object with a ``name``, a ``timeout`` (seconds) and ``run() ->
CheckResult`` (`HealthCheck`). `run_checks` runs them one after the other (a stress
test should not share the machine with another), times each, and turns what goes wrong
into a failed result: an exception, or a check still running at its timeout. A check
over its timeout is left behind on a daemon thread (Python cannot stop a thread); the
checks that run a subprocess kill it themselves at their timeout, so in practice only
an in-process check that blocks in the kernel (a hung disk) is left behind.

``fail`` names checks to fail without running them (``--inject health:check=NAME``);
such a result says it was injected and carries ``evidence["injected"] = True``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Final, Protocol

from trainguard.health.result import CheckResult

__all__ = ["TIMEOUT_GRACE", "HealthCheck", "run_check", "run_checks"]

TIMEOUT_GRACE: Final = 1.0
"""Seconds past a check's timeout before the runner gives up on it: a check that bounds
itself (its subprocess killed at the timeout) reports its own, more precise failure."""


class HealthCheck(Protocol):
    """One on-start check: a small unit with a name and a time bound."""

    @property
    def name(self) -> str: ...

    @property
    def timeout(self) -> float:
        """Seconds the check may take; past them (plus `TIMEOUT_GRACE`) it has failed."""
        ...

    def run(self) -> CheckResult:
        """Run the check on this machine; may raise (the runner turns it into a failure)."""
        ...


def run_checks(
    checks: Sequence[HealthCheck], fail: Collection[str] = frozenset()
) -> list[CheckResult]:
    """Each check's result, in order; never raises for a check's fault.

    ``fail``: names of checks to fail without running them (fault injection). A name
    that is not among ``checks`` is a ``ValueError`` (a typo must not pass silently).
    """
    names = [check.name for check in checks]
    unknown = sorted(set(fail) - set(names))
    if unknown:
        raise ValueError(
            f"no health check named {unknown[0]!r} (checks: {', '.join(names) or 'none'})"
        )
    return [_injected(check) if check.name in fail else run_check(check) for check in checks]


def run_check(check: HealthCheck) -> CheckResult:
    """One check, bounded by its timeout (plus `TIMEOUT_GRACE`), timed by wall clock."""
    box: list[CheckResult | BaseException] = []

    def target() -> None:
        try:
            box.append(check.run())
        except BaseException as exc:  # reported as the check's failure
            box.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=target, name=f"health-{check.name}", daemon=True)
    thread.start()
    thread.join(check.timeout + TIMEOUT_GRACE)
    seconds = time.monotonic() - start
    if not box:
        return CheckResult(
            check.name,
            "failed",
            f"timed out: still running after {check.timeout:g} s",
            {"timeout_s": check.timeout},
            seconds,
        )
    outcome = box[0]
    if isinstance(outcome, BaseException):
        return CheckResult(
            check.name,
            "failed",
            f"error: {type(outcome).__name__}: {outcome}",
            {"exception": type(outcome).__name__},
            seconds,
        )
    return replace(outcome, name=check.name, seconds=seconds)


def _injected(check: HealthCheck) -> CheckResult:
    return CheckResult(
        check.name,
        "failed",
        "failed by injection (a rehearsal): the check did not run",
        {"injected": True},
        0.0,
    )
