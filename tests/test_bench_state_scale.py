"""The ``state_scale`` bench scenario's verdicts and the log lines it reads (no runs)."""

from __future__ import annotations

from bench.state_scale import _JOINED, _TRANSFER, targets


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
