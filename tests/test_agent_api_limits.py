"""The agent API's limits: the token before the body, bounded bodies, connections, threads
and time, and a dropped connection that costs one log line at most.

Against a real agent process (``agent_harness``) where the agent's own numbers are what
is tested; against an in-process server with short limits where the point is a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_harness import TOKEN, AgentProcess, spawn_agent
from conftest import wait_for
from trainguard.agent.api import MAX_JSON_BYTES
from trainguard.agent.client import AgentClient, AgentError
from trainguard.agent.replica_batch import frame_header
from trainguard.agent.replicas import ReplicaStore
from trainguard.agent.server import AgentHTTPServer, ServerLimits
from trainguard.wire.requests import (
    AssignRequest,
    AttachRequest,
    AttemptRequest,
    InjectRequest,
    PersistRequest,
    ReplaceRequest,
    StopRequest,
)
from trainguard.wire.status import NodeState, NodeStatus

LIMITS = ServerLimits()
REPLY_TIMEOUT = 20.0  # s: generous, the machine is shared


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    proc = spawn_agent(tmp_path_factory.mktemp("agent-limits"))
    yield proc
    proc.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=REPLY_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(method: str, path: str, token: str | None = TOKEN, **headers: str | int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: agent"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


_unread: weakref.WeakKeyDictionary[socket.socket, bytes] = weakref.WeakKeyDictionary()


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One reply: (status, headers in lower case, body)."""
    data = _unread.pop(sock, b"")
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            raise ConnectionError(f"closed before a whole reply: {data!r}")
        data += more
    raw, _, body = data.partition(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(body) < length:
        more = sock.recv(65536)
        if not more:
            raise ConnectionError("closed inside a reply's body")
        body += more
    _unread[sock] = body[length:]
    return status, headers, body[:length]


def error_of(body: bytes) -> str:
    error = json.loads(body)["error"]
    assert isinstance(error, str)
    return error


def everything_until_closed(sock: socket.socket) -> bytes:
    """What the other end sends before it closes ``sock``."""
    sock.settimeout(REPLY_TIMEOUT)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def closed_by_peer(sock: socket.socket, timeout: float = REPLY_TIMEOUT) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` (unread bytes ignored)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a crashed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def socket_count(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


# -- the token comes first -----------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_request_without_the_token_gets_401_before_its_body_is_read(
    agent: AgentProcess, token: str | None
) -> None:
    with connect(agent.port) as sock:
        # The head announces 1 MiB and none of it is sent: the answer cannot wait for it.
        sock.sendall(head("POST", "/start", token, Content_Length=MAX_JSON_BYTES))
        status, headers, body = read_reply(sock)
        assert status == 401 and "token" in error_of(body)
        assert headers["connection"] == "close"
        assert closed_by_peer(sock)
    assert agent.client.status().state is NodeState.READY


def test_a_refused_body_sent_anyway_costs_the_agent_nothing(agent: AgentProcess) -> None:
    with connect(agent.port) as sock:
        sock.sendall(head("POST", "/start", "wrong", Content_Length=MAX_JSON_BYTES))
        with contextlib.suppress(OSError):  # a reset is the expected end of it
            sock.sendall(b"x" * MAX_JSON_BYTES)
    assert agent.client.status().state is NodeState.READY
    assert "Traceback" not in agent.stderr()


# -- bodies have bounds --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "length", "names"),
    [
        ("POST", "/start", MAX_JSON_BYTES + 1, f"larger than {MAX_JSON_BYTES} bytes"),
        ("POST", "/stop", 10**15, f"larger than {MAX_JSON_BYTES} bytes"),
        ("GET", "/status", 1, "takes no body"),
        ("POST", "/shutdown", 2, "takes no body"),
    ],
)
def test_a_body_over_its_bound_gets_413_unread(
    agent: AgentProcess, method: str, path: str, length: int, names: str
) -> None:
    with connect(agent.port) as sock:
        sock.sendall(head(method, path, Content_Length=length))
        status, headers, body = read_reply(sock)
        assert (status, headers["connection"]) == (413, "close")
        assert names in error_of(body)
        assert closed_by_peer(sock)
    assert agent.client.status().state is NodeState.READY  # /shutdown did not happen


def test_a_body_at_its_bound_is_read_and_judged(agent: AgentProcess) -> None:
    body = b"[" + b" " * (MAX_JSON_BYTES - 2) + b"]"
    with connect(agent.port) as sock:
        sock.sendall(head("POST", "/stop", Content_Length=len(body)) + body)
        status, _, reply = read_reply(sock)
    assert status == 400 and "expected a JSON object" in error_of(reply)


@pytest.mark.parametrize(
    ("headers", "status", "names"),
    [
        ({"Transfer_Encoding": "chunked"}, 411, "Content-Length"),
        ({"Content_Length": "-5"}, 400, "Content-Length"),
        ({"Content_Length": "12abc"}, 400, "Content-Length"),
        ({"Content_Length": "1" * 40}, 400, "Content-Length"),
    ],
)
def test_bodies_without_a_plain_length_are_refused(
    agent: AgentProcess, headers: dict[str, str], status: int, names: str
) -> None:
    with connect(agent.port) as sock:
        sock.sendall(head("POST", "/stop", **headers) + b"2\r\n{}\r\n0\r\n\r\n")
        got, _, body = read_reply(sock)
        assert got == status and names in error_of(body)
        assert closed_by_peer(sock)


def test_a_head_over_its_bound_gets_431(agent: AgentProcess) -> None:
    with connect(agent.port) as sock:
        sock.sendall(head("GET", "/status", X_Padding="a" * LIMITS.head_bytes))
        status, _, body = read_reply(sock)
        assert status == 431 and f"{LIMITS.head_bytes} bytes" in error_of(body)
        assert closed_by_peer(sock)


def test_bad_request_lines_get_400(agent: AgentProcess) -> None:
    for line in (b"GARBAGE\r\n\r\n", b"GET /status SPDY/3\r\n\r\n", b"GET status HTTP/1.1\r\n\r\n"):
        with connect(agent.port) as sock:
            sock.sendall(line)
            status, _, body = read_reply(sock)
            assert status == 400 and "bad request line" in error_of(body)


# -- connections and threads ---------------------------------------------------------------


def test_300_idle_connections_do_not_grow_the_agents_threads(agent: AgentProcess) -> None:
    client = agent.client
    client.status()  # the controller's connection, kept alive
    threads_before = thread_count(agent.proc.pid)
    sockets_before = socket_count(agent.proc.pid)
    idle = []
    try:
        for i in range(300):
            sock = connect(agent.port)
            if i % 3 == 0:  # some send half a head, and nothing more (slowloris)
                sock.sendall(b"GET /status HTTP/1.1\r\nHost: agent\r\n")
            idle.append(sock)
        time.sleep(1.0)
        threads = thread_count(agent.proc.pid)
        assert threads <= threads_before + LIMITS.workers, (threads_before, threads)
        # The agent holds at most its cap of connections (the oldest idle are closed).
        assert socket_count(agent.proc.pid) <= sockets_before + LIMITS.connections
        # The controller's status poll is still answered (over a kept-alive connection
        # or, when the agent closed that as the longest idle, a new one).
        for _ in range(5):
            began = time.monotonic()
            assert client.status().state is NodeState.READY
            assert time.monotonic() - began < REPLY_TIMEOUT
        assert thread_count(agent.proc.pid) <= threads_before + LIMITS.workers
    finally:
        for sock in idle:
            sock.close()
        client.close()
    assert agent.client.status().state is NodeState.READY


def test_a_kept_alive_connection_serves_many_requests(agent: AgentProcess) -> None:
    with connect(agent.port) as sock:
        for _ in range(20):
            sock.sendall(head("GET", "/status"))
            status, headers, _ = read_reply(sock)
            assert status == 200 and "connection" not in headers
        # Two requests in one write (pipelined): two replies, in order.
        sock.sendall(head("GET", "/status") + head("GET", "/nowhere"))
        assert read_reply(sock)[0] == 200
        assert read_reply(sock)[0] == 404


def test_expect_100_continue_is_answered_before_the_body(agent: AgentProcess) -> None:
    body = json.dumps({"attempt": 99}).encode()
    with connect(agent.port) as sock:
        sock.sendall(head("POST", "/stop", Content_Length=len(body), Expect="100-continue"))
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert read_reply(sock)[0] == 202


# -- a dropped connection is one line at most ----------------------------------------------


def test_dropped_connections_write_one_line_at_most_and_no_traceback(tmp_path: Path) -> None:
    agent = spawn_agent(tmp_path, extra_args=["--log-level", "DEBUG"])
    status_request = head("GET", "/status")
    ways = [
        b"GET /status HTTP/1.1\r\nHost: ag",  # inside the head
        head("POST", "/stop", Content_Length=100) + b'{"mo',  # inside the body
        status_request,  # before the reply is read
        status_request * 50,  # with replies unread
        os.urandom(300),  # not HTTP
        bytes.fromhex("16030100a5010000a103") + os.urandom(100),  # a TLS hello
    ]
    try:
        before = len(agent.stderr().splitlines())
        drops = 0
        for data in ways:
            for close in (socket.socket.close, reset):
                sock = connect(agent.port)
                sock.sendall(data)
                time.sleep(0.05)
                close(sock)
                drops += 1
        time.sleep(1.0)
        assert agent.client.status().state is NodeState.READY
        log = agent.stderr()
    finally:
        agent.close()
    assert "Traceback" not in log
    # At DEBUG each request answered is a line of its own; the rest is about the drops.
    lines = log.splitlines()[before:]
    about_drops = [line for line in lines if not re.search(r" -> \d{3}$", line)]
    assert len(about_drops) <= drops, "\n".join(about_drops)
    assert all(" WARNING " not in line and " ERROR " not in line for line in lines), lines


def test_at_info_a_dropped_connection_writes_nothing(agent: AgentProcess) -> None:
    before = agent.stderr()
    for _ in range(20):
        sock = connect(agent.port)
        sock.sendall(head("POST", "/stop", Content_Length=100) + b"{")
        reset(sock)
    agent.client.status()
    time.sleep(0.5)
    assert agent.stderr() == before


# -- replica PUTs fit the memory tier ------------------------------------------------------


@pytest.fixture(scope="module")
def replica_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    tmp = tmp_path_factory.mktemp("replica-limits")
    memory = tmp / "shm" / "node-0" / "memory"
    memory.mkdir(parents=True)
    proc = spawn_agent(
        tmp,
        extra_args=[
            "--env",
            f"TRAINGUARD_CHECKPOINT_MEMORY_DIR={memory}",
            "--max-replica-bytes",
            str(1 << 20),
        ],
    )
    yield proc
    proc.close()


def put(agent: AgentProcess, path: str, data: bytes, declared: int | None = None) -> int:
    declared = len(data) if declared is None else declared
    with connect(agent.port) as sock:
        sock.sendall(head("PUT", path, Content_Length=declared))
        sock.sendall(data)
        return read_reply(sock)[0]


def test_a_replica_put_over_the_bound_gets_413_unread(replica_agent: AgentProcess) -> None:
    replicas = replica_agent.log_dir.parent / "shm" / "node-0" / "replicas"
    with connect(replica_agent.port) as sock:
        sock.sendall(head("PUT", "/replica/node-1/rank-0-slot-0.data", Content_Length=2 << 20))
        status, _, body = read_reply(sock)  # at once: nothing of the body was sent
        assert status == 413 and f"room for {1 << 20}" in error_of(body)
        assert closed_by_peer(sock)
    assert not list(replicas.rglob("*"))  # nothing written, not even a temporary file


def test_replica_puts_share_the_agents_bound(replica_agent: AgentProcess) -> None:
    base = "/replica/node-1/rank-0-slot-1"
    assert put(replica_agent, f"{base}.data", b"a" * 700_000) == 201
    assert put(replica_agent, f"{base}.data", b"b" * 700_000) == 201  # replaces: fits
    with connect(replica_agent.port) as sock:  # beside it, 400 KB do not fit in 1 MiB
        sock.sendall(head("PUT", f"{base}.meta", Content_Length=400_000))
        assert read_reply(sock)[0] == 413
    assert put(replica_agent, f"{base}.meta", b"{}") == 201


def test_a_replica_put_needs_a_length_and_a_safe_path(replica_agent: AgentProcess) -> None:
    with connect(replica_agent.port) as sock:
        sock.sendall(head("PUT", "/replica/node-1/x.data"))
        status, _, body = read_reply(sock)
        assert status == 411 and "Content-Length" in error_of(body)
    with connect(replica_agent.port) as sock:
        sock.sendall(head("PUT", "/replica/node-1/..%2F..%2Fescape", Content_Length=2) + b"{}")
        status, _, body = read_reply(sock)
        assert status == 400 and "not a plain relative path" in error_of(body)
    with connect(replica_agent.port) as sock:
        sock.sendall(head("PUT", "/replica/node-1/a%00b", Content_Length=2) + b"{}")
        assert read_reply(sock)[0] == 400


def test_replica_room_is_the_free_space_without_a_bound(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "replicas")
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    assert abs(store.room("node-1", "a.data") - free) < 64 << 20
    bounded = ReplicaStore(tmp_path / "replicas", max_bytes=100)
    assert bounded.room("node-1", "a.data") == 100
    (tmp_path / "replicas" / "node-2").mkdir(parents=True)
    (tmp_path / "replicas" / "node-2" / "b.data").write_bytes(b"x" * 60)
    assert bounded.room("node-1", "a.data") == 40
    assert bounded.room("node-2", "b.data") == 100  # a file's replacement


def test_bad_max_replica_bytes_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="max-replica-bytes"):
        spawn_agent(tmp_path, extra_args=["--max-replica-bytes", "lots"])


# -- timeouts and caps (an in-process server with short limits) ----------------------------


class StubNode:
    """A node that accepts everything and does nothing."""

    node_id = "node-0"

    def snapshot(self) -> NodeStatus:
        return NodeStatus(node_id="node-0", pid=1, state=NodeState.READY, updated_at=0.0)

    def request_start(self, request: AttemptRequest) -> None: ...
    def request_rejoin(self, request: AttemptRequest) -> None: ...
    def request_replace(self, request: ReplaceRequest) -> None: ...
    def request_stop(self, request: StopRequest) -> None: ...
    def request_persist(self, request: PersistRequest) -> None: ...
    def request_inject(self, request: InjectRequest) -> None: ...
    def request_attach(self, request: AttachRequest) -> None: ...
    def request_assign(self, request: AssignRequest) -> None: ...
    def request_shutdown(self, reason: str) -> None: ...


SHORT = ServerLimits(
    workers=3,
    replica_transfers=1,
    connections=6,
    per_peer=3,
    head_seconds=1.0,
    idle_seconds=1.5,
    io_seconds=1.0,
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AgentHTTPServer]:
    store = ReplicaStore(tmp_path / "replicas")
    server = AgentHTTPServer("127.0.0.1", 0, StubNode(), TOKEN, store, SHORT)
    server.start()
    yield server
    server.stop()


def test_one_address_holds_at_most_its_share_of_connections(server: AgentHTTPServer) -> None:
    """127.0.0.2 plays another host (127.0.0.1, this host's, counts against the total
    only): past its share it is refused at once, and the controller is still answered."""
    held = []
    for _ in range(SHORT.per_peer + 1):
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", server.port))
        held.append(sock)
    try:
        for sock in held[:-1]:
            sock.sendall(head("GET", "/status"))
            assert read_reply(sock)[0] == 200
        with contextlib.suppress(OSError):
            held[-1].sendall(head("GET", "/status"))
        assert everything_until_closed(held[-1]) == b""  # refused: closed unanswered
        with connect(server.port) as sock:
            sock.sendall(head("GET", "/status"))
            assert read_reply(sock)[0] == 200
    finally:
        for sock in held:
            sock.close()


def test_a_head_must_come_whole_in_time(server: AgentHTTPServer) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /status HTTP/1.1\r\n")
        began = time.monotonic()
        status, _, body = read_reply(sock)
        assert status == 408 and "head incomplete" in error_of(body)
        assert time.monotonic() - began < SHORT.head_seconds + 5.0
        assert closed_by_peer(sock)


def test_a_body_must_come_whole_in_time(server: AgentHTTPServer) -> None:
    with connect(server.port) as sock:
        sock.sendall(head("POST", "/stop", Content_Length=10) + b"{")
        status, _, body = read_reply(sock)
        assert status == 408 and "body incomplete" in error_of(body)
        assert closed_by_peer(sock)


def test_a_replica_batch_that_stalls_midway_is_dropped_in_time(
    server: AgentHTTPServer, tmp_path: Path
) -> None:
    """A file's bytes stop coming: the transfer ends within the io timeout (the splice
    waits in the kernel), and nothing of the file stays."""
    body = frame_header("a.data", 10_000) + b"x" * 3000
    with connect(server.port) as sock:
        sock.sendall(head("POST", "/replica/node-1", Content_Length=len(body) + 7000) + body)
        began = time.monotonic()
        assert closed_by_peer(sock, timeout=SHORT.io_seconds + 10.0)
        assert time.monotonic() - began >= SHORT.io_seconds - 0.1
    held = tmp_path / "replicas" / "node-1"
    assert not held.exists() or list(held.iterdir()) == []


def test_a_replica_batch_that_stalls_between_files_is_dropped_in_time(
    server: AgentHTTPServer, tmp_path: Path
) -> None:
    """The next header stops coming after a file spliced whole (the socket blocks from
    the first splice to the body's end): the transfer still ends within the io timeout;
    the whole file stands, nothing of the next one does."""
    data = os.urandom(200_000)
    body = frame_header("a.data", len(data)) + data + b'{"path": "b.da'
    with connect(server.port) as sock:
        sock.sendall(head("POST", "/replica/node-1", Content_Length=len(body) + 100) + body)
        began = time.monotonic()
        assert everything_until_closed(sock) == b""  # a timeout: dropped, not a 507
        assert SHORT.io_seconds - 0.1 <= time.monotonic() - began < SHORT.io_seconds + 10.0
    held = tmp_path / "replicas" / "node-1"
    assert sorted(p.name for p in held.iterdir()) == ["a.data"]
    assert (held / "a.data").read_bytes() == data


def test_an_idle_connection_is_closed(server: AgentHTTPServer) -> None:
    with connect(server.port) as sock:
        sock.sendall(head("GET", "/status"))
        assert read_reply(sock)[0] == 200
        began = time.monotonic()
        assert closed_by_peer(sock, timeout=SHORT.idle_seconds + 5.0)
        assert time.monotonic() - began >= SHORT.idle_seconds - 0.1
    assert server.connection_count() == 0


def test_over_the_cap_the_longest_idle_connection_is_closed(server: AgentHTTPServer) -> None:
    client = AgentClient(f"http://127.0.0.1:{server.port}", TOKEN)
    client.status()
    others = [connect(server.port) for _ in range(3 * SHORT.connections)]
    try:
        wait_for(lambda: server.connection_count() <= SHORT.connections, timeout=10.0)
        # The client's connection was among the longest idle: it reconnects, and is served.
        assert client.status().state is NodeState.READY
        assert sum(closed_by_peer(sock, timeout=0.2) for sock in others) >= 2 * SHORT.connections
    finally:
        for sock in others:
            sock.close()
        client.close()


def test_the_client_keeps_one_connection_alive(server: AgentHTTPServer) -> None:
    client = AgentClient(f"http://127.0.0.1:{server.port}", TOKEN)
    try:
        for _ in range(50):
            client.status()
        assert server.connection_count() == 1
    finally:
        client.close()


@pytest.fixture
def patient_server(tmp_path: Path) -> Iterator[AgentHTTPServer]:
    """:func:`server` with the default timeouts: a reader may take seconds to come back
    (SHORT's 1 s drops a reply whose reader is still parsing another 6 MB at load)."""
    store = ReplicaStore(tmp_path / "replicas")
    limits = ServerLimits(workers=3, replica_transfers=1, connections=6, per_peer=3)
    server = AgentHTTPServer("127.0.0.1", 0, StubNode(), TOKEN, store, limits)
    server.start()
    yield server
    server.stop()


def test_status_polls_are_answered_in_turn_and_a_large_one_without_stalling_others(
    patient_server: AgentHTTPServer,
) -> None:
    """Polls are answered on the selector thread: two sent at once on one connection
    get two replies; a reply larger than the socket takes at once comes whole (a worker
    sends its end) while another connection's poll is answered meanwhile."""
    server = patient_server
    with connect(server.port) as sock:
        sock.sendall(head("GET", "/status") * 2)
        for _ in range(2):
            status, _, body = read_reply(sock)
            assert status == 200 and json.loads(body)["node_id"] == "node-0"
        sock.sendall(head("GET", "/status"))
        assert read_reply(sock)[0] == 200  # the connection was kept for the next poll
    stacks = {0: "frame\n" * 1_000_000}  # 6 MB: more than a socket's buffers hold
    large = StubNode().snapshot().model_copy(update={"stacks": stacks})
    server.api.node.snapshot = lambda: large  # type: ignore[method-assign]
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", server.port))
    slow.settimeout(REPLY_TIMEOUT)
    try:
        slow.sendall(head("GET", "/status"))
        time.sleep(0.2)  # the server's socket is full: the rest waits for this reader
        client = AgentClient(f"http://127.0.0.1:{server.port}", TOKEN)
        assert client.status().stacks == stacks
        client.close()
        status, _, body = read_reply(slow)
        assert status == 200 and json.loads(body)["stacks"] == {"0": stacks[0]}
    finally:
        slow.close()


def test_replica_transfers_beyond_their_cap_get_503(
    server: AgentHTTPServer, tmp_path: Path
) -> None:
    slow = connect(server.port)  # holds the one transfer: its body trickles in
    slow.sendall(head("PUT", "/replica/node-1/a.data", Content_Length=4) + b"a")
    time.sleep(0.3)
    try:
        with connect(server.port) as sock:
            sock.sendall(head("PUT", "/replica/node-1/b.data", Content_Length=1) + b"b")
            status, _, body = read_reply(sock)
            assert status == 503 and "replica transfers" in error_of(body)
        # The controller's requests still have workers.
        client = AgentClient(f"http://127.0.0.1:{server.port}", TOKEN)
        assert client.status().state is NodeState.READY
        client.close()
    finally:
        slow.close()
    assert not (tmp_path / "replicas" / "node-1" / "a.data").exists()


def test_an_unexpected_error_is_a_500_and_one_line(
    server: AgentHTTPServer, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> NodeStatus:
        raise RuntimeError("boom")

    server.api.node.snapshot = broken  # type: ignore[method-assign]
    with (
        caplog.at_level("INFO", logger="trainguard.agent"),
        pytest.raises(AgentError) as failed,
    ):
        AgentClient(f"http://127.0.0.1:{server.port}", TOKEN).status()
    assert failed.value.status == 500 and "RuntimeError" in str(failed.value)
    records = [r for r in caplog.records if r.levelname != "DEBUG"]
    assert len(records) == 1 and "boom" in records[0].getMessage()
    assert records[0].exc_info is None


def test_stop_ends_requests_under_way(tmp_path: Path) -> None:
    server = AgentHTTPServer("127.0.0.1", 0, StubNode(), TOKEN, limits=SHORT)
    server.start()
    sock = connect(server.port)
    sock.sendall(head("POST", "/stop", Content_Length=10) + b"{")  # a worker waits on it
    time.sleep(0.2)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    stopper.join(5.0)
    assert not stopper.is_alive()
    assert closed_by_peer(sock, timeout=5.0)
    sock.close()
