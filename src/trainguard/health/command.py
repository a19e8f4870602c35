"""``trainguard health-check``: the on-start suite, by hand, on this machine.

Exit status: 0 when no check failed (skipped ones are fine), 1 when one failed, 2 for a
usage error. ``-o json`` prints ``{"passed": bool, "counts": {...}, "checks": [...]}``
with each check's `CheckResult.to_json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

from trainguard.argtypes import non_negative_int
from trainguard.health.result import OUTCOMES, CheckResult
from trainguard.health.runner import run_checks
from trainguard.health.suite import (
    CHECK_NAMES,
    HYPERPOD_ALIASES,
    SuiteConfig,
    expand_check_names,
    on_start_checks,
)

__all__ = ["add_health_check_parser", "format_table", "health_check_command"]

EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


def add_health_check_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``health-check`` verb to the ``trainguard`` command's subparsers."""
    names = ", ".join([*CHECK_NAMES, *HYPERPOD_ALIASES])
    parser: argparse.ArgumentParser = sub.add_parser(
        "health-check",
        help="run the node health checks on this machine (CPU, memory, disk, /dev/shm, GPU)",
        description="Run the on-start health checks on this machine and print each result. "
        "Exit 0 when none failed, 1 when one did. Connectivity needs the job's other nodes: "
        "alone it is skipped.",
    )
    parser.add_argument(
        "--dir",
        metavar="DIR",
        help="where the disk check writes and measures free space (default: a new "
        "temporary directory, removed afterwards)",
    )
    parser.add_argument(
        "--check",
        action="append",
        metavar="NAME",
        type=_check_name,
        help=f"run only this check (repeatable, or comma-separated; {names})",
    )
    parser.add_argument(
        "--expected-gpus",
        type=non_negative_int,
        metavar="N",
        help="fail the gpu check with fewer GPUs",
    )
    parser.add_argument(
        "--min-free-mib",
        type=_amount,
        metavar="MIB",
        help=f"the disk check's free space floor (default {SuiteConfig.disk_min_free_mib:g})",
    )
    parser.add_argument(
        "--min-bandwidth",
        type=_amount,
        default=0.0,
        metavar="GBPS",
        help="the connectivity check's bus bandwidth floor (not measured with one node)",
    )
    parser.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="NAME",
        type=_check_name,
        help="fail this check without running it (a rehearsal; repeatable)",
    )
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text")
    return parser


def health_check_command(args: argparse.Namespace) -> int:
    """Run the suite ``args`` asks for, print it; the exit status."""
    checks = tuple(name for group in (args.check or [CHECK_NAMES]) for name in group)
    failing = {name for group in args.fail for name in group}
    missing = sorted(failing - set(checks))
    if missing:
        print(f"trainguard: --fail {missing[0]}: that check is not run", file=sys.stderr)
        return EXIT_USAGE
    config = SuiteConfig(
        checks=checks,
        expected_gpus=args.expected_gpus,
        min_bandwidth_gbps=args.min_bandwidth,
    )
    if args.min_free_mib is not None:
        config = replace(config, disk_min_free_mib=args.min_free_mib)
    if args.dir is not None:
        results = run_checks(on_start_checks(config, args.dir), fail=failing)
    else:
        with tempfile.TemporaryDirectory(prefix="trainguard-health-") as directory:
            results = run_checks(on_start_checks(config, directory), fail=failing)
    if args.output == "json":
        print(json.dumps(summary(results), indent=2))
    else:
        print(format_table(results))
    return EXIT_FAILED if any(result.failed for result in results) else 0


def summary(results: Sequence[CheckResult]) -> dict[str, Any]:
    """The JSON form of a suite's results."""
    counts = Counter(result.outcome for result in results)
    return {
        "passed": not counts["failed"],
        "counts": {outcome: counts[outcome] for outcome in OUTCOMES},
        "checks": [result.to_json() for result in results],
    }


def format_table(results: Sequence[CheckResult]) -> str:
    """A readable table: check, outcome, seconds, message; then the counts."""
    rows = [("CHECK", "OUTCOME", "SECONDS", "MESSAGE")]
    rows += [(r.name, r.outcome, f"{r.seconds:.2f}", r.message) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}"
        for row in rows
    ]
    counts = Counter(result.outcome for result in results)
    lines.append("")
    lines.append(", ".join(f"{counts[outcome]} {outcome}" for outcome in OUTCOMES))
    return "\n".join(lines)


def _check_name(text: str) -> tuple[str, ...]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return expand_check_names(names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _amount(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value
