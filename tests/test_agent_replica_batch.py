"""Replica batches: many files in one request to a real agent, each landing whole or not
at all; and a pusher that a commit in the memory tier wakes."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from agent_harness import TOKEN, AgentProcess
from conftest import wait_for
from test_agent_api_limits import (  # replica_agent: the fixture, one per module
    connect,
    error_of,
    head,
    read_reply,
    replica_agent,  # noqa: F401
)
from trainguard.agent.client import AgentClient
from trainguard.agent.replica_batch import file_part, frame_header, read_frame
from trainguard.agent.replica_push import MIN_GAP_SECONDS, ReplicaPusher
from trainguard.agent.replicas import restore_from_peers
from trainguard.checkpoint.files import checksum

ROOM = 1 << 20  # replica_agent's --max-replica-bytes


@pytest.fixture(scope="module")
def peer(replica_agent: AgentProcess) -> AgentProcess:  # noqa: F811 - the fixture
    """A real agent keeping replicas, at most ``ROOM`` bytes of them."""
    return replica_agent


def held(peer: AgentProcess, source: str) -> Path:
    return peer.log_dir.parent / "shm" / "node-0" / "replicas" / source


def batch(*files: tuple[str, bytes]) -> bytes:
    return b"".join(frame_header(path, len(data)) + data for path, data in files)


def post(
    peer: AgentProcess, source: str, body: bytes, declared: int | None = None
) -> socket.socket:
    sock = connect(peer.port)
    length = len(body) if declared is None else declared
    sock.sendall(head("POST", f"/replica/{source}", Content_Length=length) + body)
    return sock


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")] if root.exists() else []


def test_a_batch_lands_every_file_and_comes_back_in_one_request(
    peer: AgentProcess, tmp_path: Path
) -> None:
    files = {
        "rank-0-slot-0.data": os.urandom(300_000),
        "rank-0-slot-0.meta": b'{"checksum": "x"}',
        "dcp/step-3/rank-0.data": os.urandom(1000),
        "dcp/step-3/rank-0.json": b"{}",
        "empty.data": b"",
    }
    memory = tmp_path / "memory"
    memory.mkdir()
    for rel, data in files.items():
        (memory / rel).parent.mkdir(parents=True, exist_ok=True)
        (memory / rel).write_bytes(data)
    client = AgentClient(peer.url, TOKEN)
    with contextlib.ExitStack() as stack:
        parts = [file_part(stack.enter_context(open(memory / rel, "rb")), rel) for rel in files]
        client.upload("/replica/node-0", parts)
    client.close()
    replica = held(peer, "node-0")
    assert {rel: (replica / rel).read_bytes() for rel in files} == files
    assert tmp_files(replica) == []
    # A replacement pulls them all back in one GET: the same batch framing.
    with connect(peer.port) as sock:
        sock.sendall(head("GET", "/replica/node-0?batch=1"))
        status, _, body = read_reply(sock)
    assert status == 200
    stream = io.BytesIO(body)
    pulled = {}
    while (frame := read_frame(stream)) is not None:
        pulled[frame.path] = stream.read(frame.size)
    assert pulled == files


def test_a_torn_batch_leaves_no_partial_file(peer: AgentProcess) -> None:
    whole = os.urandom(50_000)
    torn = os.urandom(80_000)
    body = batch(("a.data", whole), ("b.data", torn))
    with post(peer, "node-2", body[:-40_000], declared=len(body)) as sock:
        sock.shutdown(socket.SHUT_WR)  # the pusher died midway
        status, _, reply = read_reply(sock)
    assert status == 400 and "ended 40000 bytes early" in error_of(reply)
    replica = held(peer, "node-2")
    assert (replica / "a.data").read_bytes() == whole  # complete before the tear: it stands
    assert not (replica / "b.data").exists()
    assert tmp_files(replica) == []


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (batch(("ok.data", b"x"), ("../escape", b"")), "not a plain relative path"),
        (batch(("ok.data", b"x"), ("/etc/escape", b"")), "not a plain relative path"),
        (batch(("ok.data", b"x")) + b"not json\n", "not JSON"),
        (batch(("ok.data", b"x")) + b'{"path": "a", "size": -1}\n', "expected a count"),
        (batch(("ok.data", b"x")) + b'{"path": "a", "size": 1, "x": 2}\n', "expected a header"),
        (batch(("ok.data", b"x")) + b"x" * 5000, "longer than 4096 bytes"),
        (batch(("ok.data", b"x")) + b'{"path": "a", ', "ended inside a header"),
    ],
)
def test_a_bad_header_in_a_batch_is_refused(peer: AgentProcess, body: bytes, error: str) -> None:
    with post(peer, "node-3", body) as sock:
        status, _, reply = read_reply(sock)
    assert status == 400 and error in error_of(reply)
    root = peer.log_dir.parent / "shm" / "node-0"
    assert not list(root.rglob("escape"))
    assert tmp_files(root) == []


def test_a_batch_file_over_the_room_is_refused_before_its_bytes(peer: AgentProcess) -> None:
    header = frame_header("big.data", ROOM + 1)
    with post(peer, "node-4", header, declared=len(header) + ROOM + 1) as sock:
        status, _, reply = read_reply(sock)  # no byte of the file sent
    assert status == 413 and "room for" in error_of(reply)
    assert not held(peer, "node-4").joinpath("big.data").exists()


def test_the_room_counts_what_earlier_batches_left(peer: AgentProcess) -> None:
    root = held(peer, "node-5").parent
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]
    room = ROOM - sum(p.stat().st_size for p in files)  # what the other tests left aside
    half = room // 2

    def status_of(body: bytes, declared: int | None = None) -> int:
        with post(peer, "node-5", body, declared) as sock:
            if declared is not None:
                sock.shutdown(socket.SHUT_WR)
            return read_reply(sock)[0]

    assert status_of(batch(("a.data", b"a" * half))) == 201
    assert status_of(batch(("b.data", b"b" * (half + 100)))) == 413  # a.data counts
    torn = batch(("b.data", b"b" * (half - 100)))
    assert status_of(torn[:-1000], declared=len(torn)) == 400
    assert not held(peer, "node-5").joinpath("b.data").exists()
    # The torn file's bytes are not counted: c.data fits beside a.data.
    assert status_of(batch(("c.data", b"c" * (half - 100)))) == 201
    # A file's replacement counts in place of the file.
    assert status_of(batch(("a.data", b"A" * (half + 50)))) == 201
    assert held(peer, "node-5").joinpath("a.data").read_bytes() == b"A" * (half + 50)
    # Files removed behind the store's back (their directory too) are found gone before
    # a refusal, and the directory is made again.
    shutil.rmtree(held(peer, "node-5"))
    assert status_of(batch(("d.data", b"d" * (room - 10)))) == 201
    held(peer, "node-5").joinpath("d.data").unlink()


def _commit_shard(memory: Path, step: int) -> bytes:
    """A checksummed shard as the memory tier commits one: data, then its meta renamed in."""
    data = os.urandom(10_000)
    (memory / "rank-0-slot-0.data").write_bytes(data)
    meta = {"rank": 0, "step": step, "nbytes": len(data), "checksum": "xxh3_128:test"}
    tmp = memory / ".rank-0-slot-0.meta.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, memory / "rank-0-slot-0.meta")
    return data


def _commit_dcp_rank(memory: Path, step: int) -> bytes:
    """A DCP step's rank file as the writer commits it: data, then its meta (renames)."""
    data = os.urandom(10_000)
    step_dir = memory / "dcp" / f"step-{step}"
    step_dir.mkdir(parents=True)
    for name, raw in (("rank-0.data", data), ("rank-0.json", b"{}")):
        (step_dir / f".{name}.tmp").write_bytes(raw)
        os.replace(step_dir / f".{name}.tmp", step_dir / name)
    return data


def test_a_dcp_step_in_new_directories_wakes_the_pusher(peer: AgentProcess, tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    memory.mkdir()
    pusher = ReplicaPusher("node-7", memory, [peer.url], TOKEN, interval=3600, safety_interval=3600)
    pusher.start()
    try:
        replica = held(peer, "node-7") / "dcp"
        for step in (4, 5):  # the second in a directory made while the pusher waits
            data = _commit_dcp_rank(memory, step)
            wait_for(lambda s=step: (replica / f"step-{s}" / "rank-0.json").exists(), timeout=30.0)
            assert (replica / f"step-{step}" / "rank-0.data").read_bytes() == data
            time.sleep(3 * MIN_GAP_SECONDS)  # its next wait begun, with nothing pending
    finally:
        pusher.stop()


def test_a_commit_wakes_the_pusher_without_its_poll(peer: AgentProcess, tmp_path: Path) -> None:
    memory = tmp_path / "memory"
    memory.mkdir()
    # Polls and safety passes an hour apart: only a change can wake it in time.
    pusher = ReplicaPusher("node-5", memory, [peer.url], TOKEN, interval=3600, safety_interval=3600)
    pusher.start()
    try:
        assert pusher.watching  # Linux: inotify
        replica = held(peer, "node-5")
        for step in (1, 2):
            data = _commit_shard(memory, step)
            meta = (memory / "rank-0-slot-0.meta").read_bytes()

            def pushed(data: bytes = data, meta: bytes = meta) -> bool:
                try:
                    return (replica / "rank-0-slot-0.meta").read_bytes() == meta and (
                        replica / "rank-0-slot-0.data"
                    ).read_bytes() == data
                except FileNotFoundError:
                    return False

            wait_for(pushed, timeout=30.0)
            time.sleep(3 * MIN_GAP_SECONDS)  # its next wait begun, with nothing pending
    finally:
        pusher.stop()


class _BadPeer(http.server.BaseHTTPRequestHandler):
    """A peer whose replica batch is torn (the first file whole, the second cut short)."""

    def do_GET(self) -> None:
        body = batch(("stale.data", b"d" * 100), ("rank-0-slot-0.data", b"m" * 100))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:-50])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_torn_restore_is_removed_and_the_next_peer_asked(
    peer: AgentProcess, tmp_path: Path
) -> None:
    data = os.urandom(1000)
    meta = json.dumps({"rank": 0, "step": 1, "nbytes": 1000, "checksum": checksum(data)})
    shard = batch(("rank-0-slot-0.data", data), ("rank-0-slot-0.meta", meta.encode()))
    with post(peer, "node-6", shard) as sock:
        assert read_reply(sock)[0] == 201
    bad = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BadPeer)
    thread = threading.Thread(target=bad.serve_forever, daemon=True)
    thread.start()
    memory = tmp_path / "memory"
    try:
        peers = {"bad": f"http://127.0.0.1:{bad.server_address[1]}", "good": peer.url}
        assert restore_from_peers("node-6", memory, peers, TOKEN) == "good"
    finally:
        bad.shutdown()
        bad.server_close()
    # Nothing of the torn batch stayed (its whole first file neither): the good copy.
    restored = {p.name: p.read_bytes() for p in memory.iterdir()}
    assert restored == {"rank-0-slot-0.data": data, "rank-0-slot-0.meta": meta.encode()}
