"""Central rank assignment: pure values, no processes."""

import pytest

from trainguard.control.assignment import (
    NodeAssignment,
    StoreEndpoint,
    assign_ranks,
    replica_sources,
)

EP = StoreEndpoint("10.0.0.1", 29500)


def test_ranks_are_contiguous_per_node_and_cover_the_world() -> None:
    nodes = assign_ranks(
        "job", ["a", "b", "c"], 4, attempt=0, endpoint=EP, restart_count=0, max_restarts=3
    )
    assert [n.node_rank for n in nodes] == [0, 1, 2]
    assert [n.global_ranks for n in nodes] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert {n.world_size for n in nodes} == {12}


def test_worker_env_is_the_torchrun_contract() -> None:
    node = assign_ranks(
        "job-1", ["a", "b"], 2, attempt=3, endpoint=EP, restart_count=3, max_restarts=5
    )[1]
    env = node.worker_env(1)
    assert env["RANK"] == "3"
    assert env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2"
    assert env["GROUP_RANK"] == "1"
    assert env["GROUP_WORLD_SIZE"] == "2"
    assert env["ROLE_RANK"] == "3"
    assert env["ROLE_WORLD_SIZE"] == "4"
    assert env["ROLE_NAME"] == "default"
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "5"
    assert env["TORCHELASTIC_RUN_ID"] == "job-1"
    assert env["TRAINGUARD_ATTEMPT"] == "3"


def test_each_attempt_has_its_own_rendezvous_namespace() -> None:
    first = assign_ranks("j", ["a"], 1, attempt=0, endpoint=EP, restart_count=0, max_restarts=1)
    second = assign_ranks(
        "j",
        ["a"],
        1,
        attempt=1,
        endpoint=StoreEndpoint("10.0.0.1", 29501),
        restart_count=1,
        max_restarts=1,
    )
    assert first[0].rendezvous_namespace != second[0].rendezvous_namespace
    assert first[0].worker_env(0)["MASTER_PORT"] != second[0].worker_env(0)["MASTER_PORT"]


def test_assignment_round_trips_through_json() -> None:
    node = assign_ranks(
        "j",
        ["a", "b"],
        2,
        attempt=1,
        endpoint=EP,
        restart_count=1,
        max_restarts=2,
        extra_env={"X": "1"},
    )[0]
    assert NodeAssignment.from_json(node.to_json()) == node


def test_unknown_json_field_is_refused() -> None:
    data = assign_ranks("j", ["a"], 1, 0, EP, 0, 0)[0].to_json()
    data["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        NodeAssignment.from_json(data)


@pytest.mark.parametrize(
    ("nodes", "nproc", "message"),
    [([], 1, "no nodes"), (["a", "a"], 1, "duplicate"), (["a"], 0, "nproc_per_node")],
)
def test_bad_input_is_refused(nodes: list[str], nproc: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        assign_ranks("j", nodes, nproc, 0, EP, 0, 0)


def test_local_rank_out_of_range() -> None:
    node = assign_ranks("j", ["a"], 2, 0, EP, 0, 0)[0]
    with pytest.raises(ValueError, match="local_rank"):
        node.worker_env(2)


def test_a_node_in_another_nodes_place_restores_that_nodes_replicas() -> None:
    # node-2 took lost node-1's place: its ranks' memory tier is node-1's replica, which
    # node-0 (the replica peer of node rank 1 before and after) holds under node-1's id.
    sources = replica_sources(["node-0", "node-1"], ["node-0", "node-2"])
    assert sources == {"node-2": "node-1"}
    nodes = assign_ranks("j", ["node-0", "node-2"], 2, 1, EP, 1, 3, replicas=1, sources=sources)
    assert [(n.replica_source, n.replica_peers) for n in nodes] == [
        (None, ("node-2",)),
        ("node-1", ("node-0",)),
    ]
    assert NodeAssignment.from_json(nodes[1].to_json()) == nodes[1]
    # The same nodes (a process restart, a lost node restarted fresh under its id): none.
    assert replica_sources(["a", "b"], ["a", "b"]) == {}
    # Another size: other ranks and world size, no shard of the old nodes fits.
    assert replica_sources(["a", "b"], ["a", "b", "c"]) == {}
    # Several places taken at once, each from the node at its node rank.
    assert replica_sources(["a", "b", "c"], ["d", "b", "e"]) == {"d": "a", "e": "c"}
