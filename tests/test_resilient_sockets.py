"""The hard abort of a gloo group: its connections are shut down, nothing else is.

The socket tests need no torch; the last one runs 4 real gloo ranks (marked e2e).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import SCRIPTS, wait_for
from trainguard.resilient.sockets import Connections, open_sockets


@contextmanager
def listening() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        yield server
    finally:
        server.close()


def connect(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A connected pair: (our end, the server's accepted end)."""
    ours = socket.create_connection(server.getsockname())
    theirs, _ = server.accept()
    return ours, theirs


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_group_s_sockets_are_those_opened_since() -> None:
    with listening() as peer:
        old, old_peer = connect(peer)
        before = open_sockets()
        new, new_peer = connect(peer)
        fds = Connections.opened_since(before, store_port=0).fds
        assert set(fds) == {new.fileno(), new_peer.fileno()}
        for s in (old, old_peer, new, new_peer):
            s.close()


def test_shuts_down_connections_but_not_the_listener_the_store_or_other_sockets() -> None:
    with listening() as peer, listening() as store:
        listener = socket.create_server(("127.0.0.1", 0))  # gloo dies if its accept fails
        new, new_peer = connect(peer)
        to_store, store_end = connect(store)
        unix, unix_peer = socket.socketpair()
        links = open_sockets()
        mine = [listener, new, to_store, unix]
        connections = Connections(
            {s.fileno(): links[s.fileno()] for s in mine}, store.getsockname()[1]
        )

        assert connections.shutdown() == 1
        assert closed_by_peer(new_peer)
        with pytest.raises(OSError):
            new.send(b"x")
        for sock, other in ((to_store, store_end), (unix, unix_peer)):
            sock.sendall(b"ok")
            assert other.recv(2) == b"ok"
        assert all(s.fileno() >= 0 for s in mine)  # descriptors left open (gloo closes them)
        for s in (*mine, new_peer, store_end, unix_peer):
            s.close()


def test_a_descriptor_reused_by_another_socket_is_left_alone() -> None:
    with listening() as peer:
        before = open_sockets()
        first, first_peer = connect(peer)
        connections = Connections.opened_since(before, store_port=0)
        number = first.fileno()
        first.close()
        first_peer.close()
        second, second_peer = connect(peer)  # likely the same number, another socket
        assert number in {second.fileno(), second_peer.fileno()}  # the number is reused
        assert connections.shutdown() == 0
        second.sendall(b"ok")
        assert second_peer.recv(2) == b"ok"
        second.close()
        second_peer.close()


def test_a_descriptor_reused_by_a_file_is_left_alone(tmp_path: Path) -> None:
    with listening() as peer:
        before = open_sockets()
        first, first_peer = connect(peer)
        connections = Connections.opened_since(before, store_port=0)
        numbers = {first.fileno(), first_peer.fileno()}
        first.close()
        first_peer.close()
        files = [open(tmp_path / f"f{i}", "w") for i in range(2)]  # noqa: SIM115
        assert numbers == {f.fileno() for f in files}  # the numbers now name files
        assert connections.shutdown() == 0
        for f in files:
            f.write("ok")
            f.close()


@pytest.mark.e2e
def test_abort_frees_a_survivor_blocked_on_a_live_peer(tmp_path: Path) -> None:
    # 4 ranks of DDP with small buckets; rank 3 is SIGKILLed mid-step. Without the abort,
    # one survivor (rank 1 in every trial here) stays blocked on a live peer until the
    # collective timeout; the script's ranks never exit after failing, so only the
    # survivors' aborts can free it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPTS / "gloo_abort.py"),
                "--out",
                str(tmp_path),
                *("--rank", str(rank), "--world", "4", "--port", str(port)),
            ],
            env=env,
            start_new_session=True,
        )
        for rank in range(4)
    ]
    try:
        wait_for(lambda: all((tmp_path / f"steps-{r}").exists() for r in range(4)), timeout=120)
        procs[3].send_signal(signal.SIGKILL)
        errors = [tmp_path / f"error-{rank}.json" for rank in range(3)]
        wait_for(lambda: all(e.exists() for e in errors), timeout=60)
        for e in errors:
            assert "error" in json.loads(e.read_text())
    finally:
        for p in procs:
            p.kill()
            p.wait()
