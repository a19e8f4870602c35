"""The ``state_scale`` scenario's table rows (:mod:`bench.state_scale`): per state size,
checkpointless and process-level recovery against a relaunch from /dev/shm snapshots,
and the checkpointless transfer's rate against the link's."""

from __future__ import annotations

from typing import Any

from bench.table_rows import Row, _x, gbps, seconds, verdict

SCENARIO = "state_scale"
SIDES = (("checkpointless", "checkpointless"), ("process_level", "process-level"))
METRICS = (("stall_s", "stall: fault -> next step"), ("lost_s", "lost: fault -> past the fault"))


def _cell(value: float | None) -> str:
    return "—" if value is None else seconds(value)


def rows(res: dict[str, Any]) -> list[Row]:
    """Per size: each side's stall and lost time against the relaunch's; the transfer."""
    found: list[Row] = []
    for gb, size in res.get("sizes", {}).items():
        theirs = size.get("relaunch") or {}
        for key, label in SIDES:
            ours = size.get(key)
            if ours is None:
                continue  # results of an older harness
            for metric, text in METRICS:
                mine, other = ours.get(metric), theirs.get(metric)
                r = mine / other if mine is not None and other else None
                found.append(
                    Row(
                        SCENARIO,
                        f"{gb} GB/rank, {label}: {text}",
                        _cell(mine),
                        "relaunch from /dev/shm",
                        _cell(other),
                        _x(r),
                        verdict(r, lower_is_better=True),
                    )
                )
        rate = ((size.get("checkpointless") or {}).get("transfer") or {}).get("gb_per_s")
        link = res.get("link_gb_per_s")
        r = rate / link if rate is not None and link else None
        found.append(
            Row(
                SCENARIO,
                f"{gb} GB/rank, checkpointless: state transfer rate",
                "—" if rate is None else gbps(rate),
                "the link (gloo send/recv)",
                "—" if link is None else gbps(link),
                _x(r),
                verdict(r, lower_is_better=False),
            )
        )
    return found
