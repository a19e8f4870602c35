"""RemoteNode.shutdown: a live host's agent and daemon are asked; a fenced one is not, and
the platform sends a fenced host's node no request."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from trainguard.control.reports import Refusal
from trainguard.hosts.launcher import RemoteNode
from trainguard.hosts.roster import HostRecord
from trainguard.platform.book import ReportBook
from trainguard.platform.local_platform import LocalPlatform
from trainguard.platform.store import Store
from trainguard.platform.transport import Delivery
from trainguard.wire.hosts import LaunchReply
from trainguard.wire.requests import StopRequest


class _Recorder(BaseHTTPRequestHandler):
    paths: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        type(self).paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def daemon() -> Iterator[tuple[str, list[str]]]:
    paths: ClassVar[list[str]] = []
    handler = type("Handler", (_Recorder,), {"paths": paths})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", paths
    finally:
        server.shutdown()
        server.server_close()


def _node(daemon_url: str, lost: bool) -> RemoteNode:
    host = HostRecord(
        host_id="h1", hostname="h1", addr="127.0.0.1", ifname=None, daemon_url=daemon_url,
        node_id="node-1", role="node", joined_at=0.0, lost=lost,
    )  # fmt: skip
    return RemoteNode("node-1", "node-1.2", host, LaunchReply(pid=1234, port=1), "t", None)


def test_a_live_hosts_daemon_is_asked_to_shut_the_node_down(
    daemon: tuple[str, list[str]],
) -> None:
    url, paths = daemon
    _node(url, lost=False).shutdown(None)
    assert paths == ["/shutdown"]


def test_a_fenced_host_is_not_contacted(daemon: tuple[str, list[str]]) -> None:
    url, paths = daemon
    _node(url, lost=True).shutdown(None)
    assert paths == []


class _Transport:
    """What the platform sends through: the node ids of the requests it was given."""

    def __init__(self) -> None:
        self.book = ReportBook()
        self.sent: list[str] = []

    def send(self, deliveries: Sequence[Delivery]) -> list[Refusal]:
        self.sent += [d.node_id for d in deliveries]
        return []


def test_no_request_goes_to_a_fenced_hosts_node(tmp_path: Path) -> None:
    """A node declared lost is not asked to stop: its calls' timeouts and retries would
    hold the controller's loop (and the replacement's launch) up for seconds."""
    transport = _Transport()
    platform = LocalPlatform(
        "job", Store(tmp_path / "state"), transport, lambda *args: None,  # type: ignore[arg-type]
        memory_root=tmp_path / "memory", say=lambda line: None,
        pump=lambda stream: None, interrupted=lambda: None,
    )  # fmt: skip
    platform.nodes = {"node-0": _node("http://127.0.0.1:1", False), "node-1": _node("", True)}
    stop = StopRequest(attempt=0, mode="process")
    platform.send([Delivery(n, "stop", 0, stop) for n in ("node-0", "node-1")])
    assert transport.sent == ["node-0"]
