"""Peer state transfer (:mod:`trainguard.resilient.transfer`): its plan as pure functions,
and a real 4-rank gloo sync (tests/scripts/transfer_worker.py) in which two holders send
at once to two receivers, in place, and the run ends bit-identical to one without the
fault, its DDP made without the initial broadcast."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SCRIPTS
from trainguard.resilient.transfer import Piece, pieces, shares

WORLD = 4


def test_small_tensors_are_packed_and_large_ones_sliced() -> None:
    made = pieces([(0, 10), (1, 300), (2, 20), (3, 30), (4, 0)], bucket_bytes=64, chunk_bytes=128)
    assert made == [
        Piece(((1, 0, 128),), packed=False),
        Piece(((1, 128, 256),), packed=False),
        Piece(((1, 256, 300),), packed=False),
        Piece(((0, 0, 10), (2, 0, 20), (3, 0, 30)), packed=True),
    ]
    assert sum(p.nbytes for p in made) == 360, "every byte once, the empty tensor none"
    full = pieces([(0, 40), (1, 40), (2, 40)], bucket_bytes=64, chunk_bytes=128)
    assert [p.parts for p in full] == [((0, 0, 40),), ((1, 0, 40),), ((2, 0, 40),)]


def test_sources_share_the_bytes_about_equally_and_in_order() -> None:
    items = pieces([(i, 100) for i in range(10)], bucket_bytes=50, chunk_bytes=100)
    runs = shares(items, 3)
    assert [p for run in runs for p in run] == items
    assert [sum(p.nbytes for p in run) for run in runs] == [300, 400, 300]
    assert shares(items, 1) == [items]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_two_holders_send_to_two_receivers_in_place_and_the_run_stays_bit_identical(
    tmp_path: Path,
) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["WORLD_SIZE"] = str(WORLD)
    procs = []
    try:
        for rank in range(WORLD):
            log = open(tmp_path / f"rank-{rank}.log", "wb")  # noqa: SIM115  # the child's
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "transfer_worker.py"), "--out", str(tmp_path)],
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                )
            )
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = "\n".join((tmp_path / f"rank-{r}.log").read_text() for r in range(WORLD))
    assert codes == [0] * WORLD, logs[-4000:]
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    assert [r["source"] for r in results] == ["self", "self", "peer", "peer"]
    assert all(r["steps"] == 4 for r in results)
    assert "peer rank 0 with ranks 1 at step 4" in results[2]["detail"], results[2]["detail"]
    assert results[2]["in_place"] and results[3]["in_place"], "received into the state's tensors"
    assert all(r["extra_ok"] for r in results), "a non-contiguous tensor arrives whole"
    # Every rank, the replacement and the one that was behind included, ends where the
    # run without the fault ends, bit for bit.
    assert {r["final"] for r in results} == {results[0]["reference"]}
    # Right after a sync DDP leaves each rank's values alone; otherwise it broadcasts.
    assert [r["kept"] for r in results] == [0.0, 1.0, 2.0, 3.0]
    assert [r["broadcast"] for r in results] == [0.0] * WORLD


@pytest.fixture(autouse=True)
def _no_stray_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
