"""The all-reduce bandwidth test between two real processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import socket
import threading

import pytest

from trainguard.health import CheckResult, ConnectivityCheck, run_checks
from trainguard.health.bandwidth import bus_bandwidth
from trainguard.health.connectivity import judge_bandwidth


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_two_nodes_measure_the_same_bandwidth_and_a_floor_above_it_fails() -> None:
    port = free_port()
    floors = {0: 0.0, 1: 1e6}  # rank 1 asks for a petabyte per second
    results: dict[int, CheckResult] = {}

    def node(rank: int) -> None:
        check = ConnectivityCheck(
            rank=rank,
            world_size=2,
            master_port=port,
            min_bandwidth_gbps=floors[rank],
            size_mib=1,
            backend="gloo",
            iterations=3,
            timeout=60,
        )
        (results[rank],) = run_checks([check])

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    passed, failed = results[0], results[1]
    assert passed.outcome == "passed", passed.message
    busbw = passed.evidence["busbw_gbps"]
    assert isinstance(busbw, float) and busbw > 0
    assert passed.evidence["backend"] == "gloo"
    assert "GB/s" in passed.message
    assert failed.outcome == "failed", failed.message
    assert failed.evidence["busbw_gbps"] == busbw  # the slowest rank's time, on both
    assert "expected minimum 1e+06 GB/s" in failed.message


def test_one_node_has_nothing_to_measure() -> None:
    (result,) = run_checks([ConnectivityCheck(world_size=1, min_bandwidth_gbps=100)])
    assert result.outcome == "skipped"


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    algbw, busbw = bus_bandwidth(size_bytes=8 * 10**9, seconds_per_op=2.0, world_size=8)
    assert algbw == pytest.approx(4.0)
    assert busbw == pytest.approx(4.0 * 2 * 7 / 8)
    assert bus_bandwidth(10**9, 1.0, 2) == pytest.approx((1.0, 1.0))


def test_the_floor_is_judged_like_hyperpods_connectivity_check() -> None:
    assert judge_bandwidth(30.0, 80.0) == (
        "failed",
        "all-reduce bus bandwidth too low: expected minimum 80 GB/s, got 30",
    )
    assert judge_bandwidth(90.0, 80.0)[0] == "passed"
