"""The ``state_scale`` bench scenario's verdicts and the log lines it reads (no runs)."""

from __future__ import annotations

from bench.state_scale import _JOINED, _TRANSFER, targets
from bench.state_scale_process import start_phases
from bench.state_scale_rows import rows


def test_the_targets_compare_the_stall_with_the_link_and_the_lost_time_with_a_relaunch() -> None:
    size = {
        "checkpointless": {
            "stall_s": 1.9,
            "step_s": 0.2,
            "lost_s": 1.9,
            "transfer": {"gb_per_s": 1.7},
        },
        "relaunch": {"lost_s": 10.0},
    }
    # link: 0.5 s/GB (2 GB/s); bound: 0.5 + 2 x 0.2 + 1.5 GB x 1.0 s/GB = 2.4 s.
    assert targets(size, 0.5, 1.5) == {
        "stall_within_bound": True,
        "transfer_at_0.8x_link": True,  # 1.7 >= 1.6 GB/s
        "lost_within_0.2x_relaunch": True,  # 1.9 <= 2.0
    }
    size["checkpointless"].update(stall_s=2.5, lost_s=2.1, transfer={"gb_per_s": 1.5})
    assert set(targets(size, 0.5, 1.5).values()) == {False}
    assert targets({"checkpointless": {}, "relaunch": {}}, 0.5, 1.5) == {
        "stall_within_bound": None,
        "transfer_at_0.8x_link": None,
        "lost_within_0.2x_relaunch": None,
    }


def test_the_phases_are_read_from_the_workers_joined_line() -> None:
    line = (
        "[trainguard.resilient] rank 1: joined attempt 1 (world 2) in 1.250 s (group 0.200 s, "
        "set-up 0.050 s, state 1.000 s); state from peer rank 0 with ranks 2,3 at step 12 "
        "(1540.0 MB in 0.950 s: layout 0.010 s, data 0.900 s (1.71 GB/s), load 0.040 s)"
    )
    joined, transfer = _JOINED.search(line), _TRANSFER.search(line)
    assert joined is not None and joined.groups() == ("1.250", "0.200", "0.050", "1.000")
    assert transfer is not None
    assert transfer.groups() == ("1540.0", "0.950", "0.010", "0.900", "1.71", "0.040")


def test_the_rows_compare_each_side_with_the_relaunch_and_the_transfer_with_the_link() -> None:
    size = {
        "checkpointless": {"stall_s": 1.0, "lost_s": 2.0, "transfer": {"gb_per_s": 1.5}},
        "process_level": {"stall_s": 4.0, "lost_s": 8.0},
        "relaunch": {"stall_s": 5.0, "lost_s": 4.0},
    }
    found = rows({"link_gb_per_s": 2.0, "sizes": {"0.4": size}})
    table = {row.metric: (row.ours, row.theirs, row.ratio, row.verdict) for row in found}
    assert table["0.4 GB/rank, checkpointless: stall: fault -> next step"][2] == "0.20x"
    lost = table["0.4 GB/rank, process-level: lost: fault -> past the fault"]
    assert lost == ("8.0 s", "4.0 s", "2.00x", "**trainguard worse**")
    rate = table["0.4 GB/rank, checkpointless: state transfer rate"]
    assert rate == ("1.5 GB/s", "2.0 GB/s", "0.75x", "**trainguard worse**")
    del size["process_level"]  # an older harness's results
    assert len(rows({"sizes": {"0.4": size}})) == 3


def test_a_restarted_ranks_start_is_split_into_phases_from_the_fault() -> None:
    record = {
        "process_started": 101.0,
        "phases": {"imports": 102.0, "group": 102.5, "model": 104.0, "load": 105.0, "ddp": 105.5},
        "restored_step": 10,
        "restore_s": 0.9,
        "restore_tier": "memory",
    }
    phases = start_phases(record, fault_at=100.0)
    assert phases["restart_s"] == 1.0 and phases["imports_s"] == 1.0
    assert phases["model_s"] == 1.5 and phases["load_s"] == 1.0 and phases["ready_s"] == 5.5
