"""What a client without the token can cost trainguard's servers, on loopback (issue 38):
connections per peer and in total, the time a request head may take, and the log lines
junk costs. The servers are the real ones with small limits: the aiohttp server
(``RouteServer``) of the controller's inbox, hosts service and host daemons, the
store service's control port, the probes and the metrics endpoint. The agents' own
server is tested in ``test_agent_api_limits.py``; the store's door in
``test_store_door.py``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from aiohttp import web

from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.daemon import PARTITION_ENV, HostDaemon
from trainguard.http_server import RouteServer
from trainguard.kube.probes import serve_probes
from trainguard.netlimits import ConnLimits, ConnTable, QuietLog
from trainguard.observe.metrics import Metrics, serve
from trainguard.platform.node import AgentLauncher
from trainguard.wire.hosts import JoinReply

LIMITS = ConnLimits(per_peer=3, total=5, head_seconds=2.0)
TOKEN = "net-bounds-token-0123456789"


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"hello": True})


@contextmanager
def route_server() -> Iterator[int]:
    server = RouteServer("127.0.0.1", 0, [web.get("/hello", hello)], limits=LIMITS)
    try:
        yield server.port
    finally:
        server.close()


@contextmanager
def probes_server() -> Iterator[int]:
    server = serve_probes(0, lambda: True, host="127.0.0.1", limits=LIMITS)
    try:
        yield server.port
    finally:
        server.close()


@contextmanager
def metrics_server() -> Iterator[int]:
    server = serve(Metrics(), 0, limits=LIMITS)
    try:
        yield server.port
    finally:
        server.close()


SERVERS: dict[str, tuple[Callable[[], AbstractContextManager[int]], str]] = {
    "route-server": (route_server, "/hello"),
    "probes": (probes_server, "/healthz"),
    "metrics": (metrics_server, "/metrics"),
}


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def closed(sock: socket.socket, within: float = 10.0) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(port: int, path: str) -> bytes:
    with connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_peer_holds_at_most_its_share_of_connections_and_the_server_keeps_answering(
    name: str,
) -> None:
    make, path = SERVERS[name]
    with make() as port:
        # 127.0.0.2 is a peer of its own (loopback counts against the total only).
        held = [connect(port, "127.0.0.2") for _ in range(LIMITS.per_peer)]
        extra = connect(port, "127.0.0.2")
        assert closed(extra, 1.5), "a connection past the peer's cap was kept"
        assert not any(closed(s, 0.2) for s in held)
        assert b" 200 " in get(port, path).split(b"\r\n")[0] + b" "


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_head_sent_byte_by_byte_or_not_at_all_is_cut_off(name: str) -> None:
    make, path = SERVERS[name]
    with make() as port:
        silent = connect(port)
        trickle = connect(port)
        started = time.monotonic()
        trickle.sendall(f"GET {path} HTTP/1.1\r\n".encode())
        cut = False
        while time.monotonic() - started < 10 and not cut:
            try:
                trickle.sendall(b"X-Slow: 1\r\n")
            except OSError:
                cut = True
            cut = cut or closed(trickle, 0.2)
        assert cut, "a head still coming after 10 s was not cut off"
        assert closed(silent, 5.0)


def test_a_full_server_closes_its_oldest_idle_connection_for_a_new_one() -> None:
    with route_server() as port:
        held = [connect(port, f"127.0.0.{i + 10}") for i in range(LIMITS.total)]
        time.sleep(0.2)
        newest = connect(port, "127.0.0.99")
        assert closed(held[0]), "the oldest idle connection was kept on a full server"
        newest.sendall(b"GET /hello HTTP/1.0\r\nHost: x\r\n\r\n")
        assert b"200 OK" in newest.recv(1024)


JUNK = [
    b"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 garbage\r\n\r\n",
    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
]


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_malformed_requests_cost_one_log_line_and_no_traceback(
    name: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    make, _ = SERVERS[name]
    with make() as port:
        for _ in range(20):
            for junk in JUNK:
                with connect(port) as sock:
                    try:
                        sock.sendall(junk)
                        closed(sock, 5.0)  # wait for its answer (a 4xx) or the close
                    except ConnectionResetError:
                        pass
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) <= len(JUNK), [r.getMessage() for r in records]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert "Traceback" not in capfd.readouterr().err


def test_the_quiet_log_says_one_line_per_kind_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    logger = logging.getLogger("test.quiet")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        quiet = QuietLog(logger, interval=10.0, clock=lambda: now[0])
        for _ in range(5):
            quiet.note("junk", "junk from 10.0.0.9\nTraceback (most recent call last):")
        quiet.note("other", "another kind")
        now[0] = 11.0
        quiet.note("junk", "junk again")
    finally:
        logger.removeHandler(handler)
    assert lines == ["junk from 10.0.0.9 Traceback (most recent call last):", "another kind",
                     "junk again (4 more like it since)"]  # fmt: skip


def test_conn_table_bounds_per_peer_and_evicts_the_oldest_idle() -> None:
    table = ConnTable(ConnLimits(per_peer=2, total=3, head_seconds=1.0))
    assert table.admit("a", "10.0.0.1") == (True, None)
    assert table.admit("b", "10.0.0.1") == (True, None)
    assert table.admit("c", "10.0.0.1") == (False, None)  # the peer's cap
    table.busy("a", True)
    assert table.admit("d", "10.0.0.2") == (True, None)
    assert table.admit("e", "10.0.0.3") == (True, "b")  # full: b is the oldest idle one
    table.busy("d", True)
    table.busy("e", True)
    assert table.admit("f", "10.0.0.4") == (False, None)  # full and all serving
    table.release("a")
    assert table.admit("g", "10.0.0.1") == (True, None)
    assert len(table) == 3


def test_the_partition_route_exists_only_when_asked_for_and_needs_its_seconds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json
    import urllib.error
    import urllib.request

    def daemon() -> HostDaemon:
        def no_launcher(reply: JoinReply) -> AgentLauncher:
            raise AssertionError("not launched")

        return HostDaemon(
            JobEndpoint("127.0.0.1", 1), TOKEN, LocalAddress("127.0.0.1", "lo"), {}, no_launcher
        )

    def post(url: str, body: object) -> int:
        request = urllib.request.Request(
            url + "/partition",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    monkeypatch.delenv(PARTITION_ENV, raising=False)
    plain = daemon()
    try:
        assert post(plain.server.url, {"seconds": 1}) == 404
    finally:
        plain.server.close()
    monkeypatch.setenv(PARTITION_ENV, "1")
    rehearsal = daemon()
    try:
        for body in ({}, {"seconds": None}, {"seconds": 0}, {"seconds": 1e9}, {"seconds": "x"}):
            assert post(rehearsal.server.url, body) == 400, body
    finally:
        rehearsal.server.close()
