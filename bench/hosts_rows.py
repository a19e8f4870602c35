"""The hosts scenario's rows of the summary table (results of :func:`bench.suite.hosts`).

Its two faults are each a fault scenario's result (:func:`bench.table_rows.fault_rows`),
labelled by the fault; the baselines are named for what they are, and the comparison
with trainguard on one host says what the hosts cost rather than who is better.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.table_rows import Fmt, Row, count, fault_rows, seconds

SCENARIO = "hosts"

# fault key in the results -> (what happened, [(metric key, label, format, lower is better)])
PARTS: dict[str, tuple[str, list[tuple[str, str, Fmt, bool]]]] = {
    "kill": (
        "rank 3 on host 1 SIGKILLed",
        [
            ("stall_s", "stall: fault -> next completed step", seconds, True),
            ("lost_steps", "steps lost (redone)", count, True),
            ("detect_s", "SIGKILL -> fault decision", seconds, True),
        ],
    ),
    "cut": (
        "host 1 cut off",
        [
            (
                "stall_s",
                "stall: cut -> next completed step (on the warm spare host)",
                seconds,
                True,
            ),
            ("lost_steps", "steps lost (redone)", count, True),
            ("detect_s", "cut -> NodeLost (fault decision)", seconds, True),
        ],
    ),
}
BASELINES = {
    "kill": {
        "baseline_one_host": "trainguard on one host (same job, same SIGKILL)",
        "baseline_relaunch": "torchrun across hosts, relaunched",
    },
    "cut": {
        "baseline_one_host": "trainguard on one host (node-kill of node 1)",
        "baseline_relaunch_at_cut": "torchrun relaunch, told at the cut",
        "baseline_torchrun": "torchrun across hosts (relaunch once one exits)",
    },
}
# trainguard against itself on one host: what the hosts cost, not who is better.
_ONE_HOST_VERDICTS = {
    "trainguard better": "less across hosts",
    "**trainguard worse**": "more across hosts",
}


def hosts_rows(res: dict[str, Any]) -> list[Row]:
    """Both faults' rows; one row saying why, when the scenario was skipped."""
    if "skipped" in res:
        return [
            Row(SCENARIO, "every figure", "—", "—", "—", "—", f"not measured: {res['skipped']}")
        ]
    rows: list[Row] = []
    for part, (what, metrics) in PARTS.items():
        if part not in res:
            continue
        names = BASELINES[part]
        labelled = [(key, f"{what}: {label}", fmt, lower) for key, label, fmt, lower in metrics]
        for row in fault_rows(SCENARIO, res[part], labelled):
            key = next((k for k, v in names.items() if row.baseline == _short(k)), None)
            if key == "baseline_one_host":
                head, _, rest = row.verdict.partition(";")
                row = replace(
                    row, verdict=_ONE_HOST_VERDICTS.get(head, head) + (";" + rest if rest else "")
                )
            rows.append(
                replace(row, baseline=names.get(key, row.baseline) if key else row.baseline)
            )
    return rows


def _short(key: str) -> str:
    """How :func:`bench.table_rows.fault_rows` names a baseline."""
    return key.removeprefix("baseline_").replace("_", " ")
