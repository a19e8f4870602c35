"""The agent's HTTP API: JSON over HTTP, every request authenticated by a bearer token.

    POST /start     {"assignment": NodeAssignment.to_json()}          -> 202, 409 if busy
    POST /stop      {"attempt": n|null, "mode": "graceful"|"process",
                     "timeout": seconds}                               -> 202
    GET  /status    AgentStatus.to_json()                             -> 200
    POST /rejoin    {"assignment": ...}: an in-process restart into that attempt
                                                                      -> 202, 409 if not
                    running resilient workers of an older attempt
    POST /persist   {"step": n, "world_size": n, "commit": bool}     -> 202, 409 if no
                    durable tier (the node's memory shards of step -> durable storage)
    POST /shutdown                                                    -> 202, then exit

Errors are ``{"error": "..."}`` with 400 (bad body, naming the field), 401
(token), 404 (path), 405 (method), 409 (refused), 413 (body too large).
Handlers only validate and queue; the supervisor thread does the work.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import math
import shutil
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainguard.agent.monitoring import build_monitor
from trainguard.agent.replicas import REPLICA_PATH, ReplicaError, ReplicaStore
from trainguard.agent.status import DEFAULT_STOP_TIMEOUT, STOP_MODES
from trainguard.agent.supervisor import Refused, Supervisor
from trainguard.control.assignment import NodeAssignment

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024


class BadRequest(ValueError):
    """The request body is wrong; the message names the field."""


def parse_assignment(data: Any, node_id: str) -> NodeAssignment:
    """Validate a ``/start`` assignment for the agent ``node_id``; raises :class:`BadRequest`."""
    if not isinstance(data, dict):
        raise BadRequest("assignment: expected a JSON object")
    fields = {f.name: f for f in dataclasses.fields(NodeAssignment)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BadRequest(f"assignment: unknown fields {unknown}")
    for name, spec in fields.items():
        where = f"assignment.{name}"
        if name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise BadRequest(f"{where}: missing")
            continue
        _check_type(where, str(spec.type), data[name])
    assignment = NodeAssignment.from_json(data)
    checks = [
        ("attempt", assignment.attempt >= 0, "expected >= 0"),
        ("nnodes", assignment.nnodes >= 1, "expected >= 1"),
        ("nproc_per_node", assignment.nproc_per_node >= 1, "expected >= 1"),
        (
            "node_rank",
            0 <= assignment.node_rank < assignment.nnodes,
            "expected 0 <= node_rank < nnodes",
        ),
        ("master_port", 1 <= assignment.master_port <= 65535, "expected 1..65535"),
        ("restart_count", assignment.restart_count >= 0, "expected >= 0"),
        ("hot_spares", assignment.hot_spares >= 0, "expected >= 0"),
        ("barrier_timeout", assignment.barrier_timeout > 0, "expected > 0"),
        ("node_id", assignment.node_id == node_id, f"this agent is {node_id!r}"),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise BadRequest(f"assignment.{name}: {expected}, got {data[name]!r}")
    try:
        build_monitor(assignment.monitor)
    except ValueError as exc:
        raise BadRequest(f"assignment.monitor: {exc}") from None
    return assignment


def _check_type(where: str, type_name: str, value: Any) -> None:
    if type_name == "bool" and not isinstance(value, bool):
        raise BadRequest(f"{where}: expected true or false, got {value!r}")
    if type_name == "float" and (
        isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    ):
        raise BadRequest(f"{where}: expected a number, got {value!r}")
    if type_name == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadRequest(f"{where}: expected an integer, got {value!r}")
    if type_name == "str" and (not isinstance(value, str) or not value):
        raise BadRequest(f"{where}: expected a non-empty string, got {value!r}")
    if type_name == "dict[str, str]" and (
        not isinstance(value, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise BadRequest(f"{where}: expected an object of strings, got {value!r}")


def parse_stop(data: Any) -> tuple[int | None, str, float, bool]:
    """Validate a ``/stop`` body: ``(attempt, mode, timeout, capture_stacks)``.

    Raises :class:`BadRequest`.
    """
    if not isinstance(data, dict):
        raise BadRequest("stop: expected a JSON object")
    unknown = sorted(set(data) - {"attempt", "mode", "timeout", "capture_stacks"})
    if unknown:
        raise BadRequest(f"stop: unknown fields {unknown}")
    attempt = data.get("attempt")
    if attempt is not None and (
        isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0
    ):
        raise BadRequest(f"stop.attempt: expected an integer >= 0 or null, got {attempt!r}")
    mode = data.get("mode", "graceful")
    if mode not in STOP_MODES:
        raise BadRequest(f"stop.mode: expected one of {', '.join(STOP_MODES)}, got {mode!r}")
    timeout = data.get("timeout", DEFAULT_STOP_TIMEOUT)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout < 0
    ):
        raise BadRequest(f"stop.timeout: expected seconds >= 0, got {timeout!r}")
    capture = data.get("capture_stacks", False)
    if not isinstance(capture, bool):
        raise BadRequest(f"stop.capture_stacks: expected true or false, got {capture!r}")
    return attempt, str(mode), float(timeout), capture


class AgentHTTPServer(ThreadingHTTPServer):
    """Serves one :class:`Supervisor`; binds on construction (port 0: any free port)."""

    daemon_threads = True

    def __init__(
        self,
        host: str,
        port: int,
        supervisor: Supervisor,
        token: str,
        replicas: ReplicaStore | None = None,
    ) -> None:
        if not token:
            raise ValueError("token must not be empty")
        self.supervisor = supervisor
        self.replicas = replicas
        self.token = token.encode()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        """Serve on a background thread."""
        self._thread = threading.Thread(
            target=self.serve_forever, name="trainguard-agent-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: AgentHTTPServer
    server_version = "trainguard-agent"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        if self.path.startswith(REPLICA_PATH):
            self._replica(method)
            return
        try:
            body = self._read_body()
        except BadRequest as exc:
            self._reply(413, {"error": str(exc)})
            return
        if not self._authorized():
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        path = self.path.split("?", 1)[0]
        routes = {
            ("GET", "/status"): self._status,
            ("POST", "/start"): self._start,
            ("POST", "/stop"): self._stop,
            ("POST", "/shutdown"): self._shutdown,
            ("POST", "/persist"): self._persist,
            ("POST", "/rejoin"): self._rejoin,
        }
        action = routes.get((method, path))
        if action is None:
            allowed = [m for m, p in routes if p == path]
            if allowed:
                self._reply(405, {"error": f"{path} takes {allowed[0]}"}, {"Allow": allowed[0]})
            else:
                self._reply(404, {"error": f"no such path: {path}"})
            return
        try:
            action(body)
        except BadRequest as exc:
            self._reply(400, {"error": str(exc)})
        except Refused as exc:
            self._reply(409, {"error": str(exc)})

    def _replica(self, method: str) -> None:
        """``PUT /replica/<node>/<file>`` (streamed), ``GET /replica/<node>[/<file>]``."""
        if not self._authorized():
            self._reply(401, {"error": "missing or wrong bearer token"})
            return
        store = self.server.replicas
        if store is None:
            self._reply(404, {"error": "this agent keeps no replicas (no memory tier)"})
            return
        rest = urllib.parse.unquote(self.path.split("?", 1)[0][len(REPLICA_PATH) :])
        source, _, relpath = rest.partition("/")
        try:
            if method == "PUT" and relpath:
                length = int(self.headers.get("Content-Length") or 0)
                store.receive(source, relpath, self.rfile, length)
                self._reply(201, {"stored": relpath})
            elif method == "GET" and not relpath:
                self._reply(200, {"files": store.listing(source)})
            elif method == "GET":
                path = store.path(source, relpath)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 4 * 1024 * 1024)
            else:
                self._reply(405, {"error": f"{method} {REPLICA_PATH}... is not supported"})
        except (ReplicaError, ValueError) as exc:
            self._reply(400, {"error": str(exc)})
        except FileNotFoundError as exc:
            self._reply(404, {"error": str(exc)})

    def _status(self, body: bytes) -> None:
        self._reply(200, self.server.supervisor.snapshot().to_json())

    def _start(self, body: bytes) -> None:
        data = _json_object(body, required=True)
        if "assignment" not in data:
            raise BadRequest("assignment: missing")
        unknown = sorted(set(data) - {"assignment"})
        if unknown:
            raise BadRequest(f"start: unknown fields {unknown}")
        assignment = parse_assignment(data["assignment"], self.server.supervisor.node_id)
        self.server.supervisor.request_start(assignment)
        self._reply(202, {"accepted": True, "attempt": assignment.attempt})

    def _stop(self, body: bytes) -> None:
        attempt, mode, timeout, capture = parse_stop(_json_object(body, required=False))
        self.server.supervisor.request_stop(attempt, mode, timeout, capture_stacks=capture)
        self._reply(202, {"accepted": True})

    def _rejoin(self, body: bytes) -> None:
        data = _json_object(body, required=True)
        unknown = sorted(set(data) - {"assignment"})
        if unknown or "assignment" not in data:
            raise BadRequest(f"rejoin: expected exactly the field 'assignment', got {sorted(data)}")
        assignment = parse_assignment(data["assignment"], self.server.supervisor.node_id)
        self.server.supervisor.request_rejoin(assignment)
        self._reply(202, {"accepted": True, "attempt": assignment.attempt})

    def _persist(self, body: bytes) -> None:
        step, world_size, commit = parse_persist(_json_object(body, required=True))
        self.server.supervisor.request_persist(step, world_size, commit)
        self._reply(202, {"accepted": True, "step": step})

    def _shutdown(self, body: bytes) -> None:
        try:
            self._reply(202, {"accepted": True})
        finally:  # even if the caller hung up before reading the reply
            self.server.supervisor.request_shutdown("shutdown requested")

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest("Content-Length: not a number") from None
        if length > MAX_BODY_BYTES:
            raise BadRequest(f"body larger than {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length) if length > 0 else b""

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization") or ""
        scheme, _, credential = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(credential.strip().encode(), self.server.token)

    def _reply(
        self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()


def parse_persist(data: dict[str, Any]) -> tuple[int, int, bool]:
    """Validate a ``/persist`` body: ``(step, world_size, commit)``."""
    unknown = sorted(set(data) - {"step", "world_size", "commit"})
    if unknown:
        raise BadRequest(f"persist: unknown fields {unknown}")
    step, world_size, commit = data.get("step"), data.get("world_size"), data.get("commit", False)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadRequest(f"step: expected an integer >= 0, got {step!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise BadRequest(f"world_size: expected an integer >= 1, got {world_size!r}")
    if not isinstance(commit, bool):
        raise BadRequest(f"commit: expected true or false, got {commit!r}")
    return step, world_size, commit


def _json_object(body: bytes, required: bool) -> dict[str, Any]:
    if not body.strip():
        if required:
            raise BadRequest("body: expected a JSON object, got nothing")
        return {}
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body: malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest("body: expected a JSON object")
    return data
