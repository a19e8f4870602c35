"""Fuzz every route of a live agent with hostile bodies: only clean refusals come out.

Random JSON, wrong types, huge numbers, deep nesting, invalid UTF-8 and one-field
mutations of each route's valid body go to a real agent process over one kept-alive
connection. Every answer must be a 2xx (a body that happens to be valid) or a 4xx whose
body is ``{"error": "<one line>"}``; never a 5xx or a dropped connection. Afterwards the
agent still answers and its log has no traceback and no error of its HTTP server.

The bodies are built so that none can make the agent do anything: assignments name
another node (or, for the monitor's rules, one attempt whose worker exits at once), and
``/shutdown`` only ever gets a body (which it refuses).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_harness import TOKEN, AgentProcess, make_assignment, spawn_agent
from trainguard.agent.api import MAX_JSON_BYTES, AgentApi

NODE_ID = "fuzz-node"
ROUTES = sorted(AgentApi.ROUTES)
API = AgentApi.__new__(AgentApi)  # for body_limit: no node behind it
FUZZ = settings(
    max_examples=1000,
    deadline=None,  # a shared machine: one request may take a while
    database=None,  # nothing written to the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def valid_bodies() -> dict[str, dict[str, Any]]:
    """A valid body per route, whose acceptance does nothing (another node's assignment)."""
    assignment = make_assignment("someone-else").to_json()
    return {
        "/start": {"assignment": assignment, "peers": {}, "report_url": None},
        "/rejoin": {"assignment": assignment, "peers": {"a": "http://127.0.0.1:9"}},
        "/replace": {"attempt": 0, "ranks": [0, 1]},
        "/stop": {"attempt": 7, "mode": "graceful", "timeout": 1.0, "capture_stacks": False},
        "/persist": {"step": 10, "world_size": 2, "commit": True},
        "/inject": {"injections": [{"id": 0, "kind": "kill", "rank": 0, "at_step": 5}]},
        "/attach": {"report_url": "http://127.0.0.1:9/report", "pid": 1, "start": 5},
    }


VALID = valid_bodies()

EXTREME_NUMBERS = st.sampled_from(
    [2**31, 2**63, -(2**63) - 1, 2**64, 10**100, 10**4000, -0.0, 1e308, 5e-324, 1e-400]
)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | EXTREME_NUMBERS
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
JSON = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=25,
)
INVALID_UTF8 = st.sampled_from(
    [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf"]
)


def encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """``base`` with one value somewhere in it replaced, removed, or a field added."""
    paths: list[tuple[Any, ...]] = []

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        if isinstance(value, dict):
            for key, child in value.items():
                walk(child, (*path, key))
        elif isinstance(value, list):
            for i, child in enumerate(value):
                walk(child, (*path, i))

    walk(base, ())
    path = draw(st.sampled_from(paths))
    body = json.loads(json.dumps(base))
    if not path:
        return draw(JSON)
    parent = body
    for part in path[:-1]:
        parent = parent[part]
    action = draw(st.sampled_from(["replace", "replace", "remove", "add"]))
    if action == "replace":
        parent[path[-1]] = draw(JSON | EXTREME_NUMBERS)
    elif action == "remove":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=12))] = draw(JSON)
    return body


def nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@st.composite
def with_bad_bytes(draw: st.DrawFn, raw: bytes) -> bytes:
    at = draw(st.integers(0, len(raw)))
    return raw[:at] + draw(INVALID_UTF8) + raw[at:]


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """Hostile bodies for ``path`` (never empty: an empty body is a valid /shutdown)."""
    base = VALID.get(path, {})
    return st.one_of(
        JSON.map(encode),
        mutated(base).map(encode),
        mutated(base).map(encode).flatmap(with_bad_bytes),
        st.binary(min_size=1, max_size=200),
        st.tuples(st.integers(1, 5000), st.sampled_from(["list", "dict"])).map(
            lambda args: nested(*args)
        ),
    ).filter(bool)


REQUESTS = st.sampled_from(ROUTES).flatmap(
    lambda route: bodies(route[1]).map(lambda body: (route[0], route[1], body))
)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    proc = spawn_agent(tmp_path_factory.mktemp("agent-fuzz"), node_id=NODE_ID)
    yield proc
    proc.close()
    log = proc.stderr()
    assert "Traceback" not in log, log[-5000:]
    assert " WARNING trainguard.agent.server" not in log, log[-5000:]
    assert " WARNING trainguard.agent.http" not in log, log[-5000:]
    assert " ERROR " not in log, log[-5000:]


class Caller:
    """One kept-alive connection to the agent (reopened when the agent closes it)."""

    def __init__(self, agent: AgentProcess) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=30)

    def __call__(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, reply)``; ``(413, ...)`` too when the agent refused a body over its
        bound unread and closed the connection before this end could read why."""
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        try:
            self.connection.request(method, path, body=body, headers=headers)
            response = self.connection.getresponse()
            reply = response.read()
        except (BrokenPipeError, ConnectionResetError):
            self.connection.close()
            assert len(body) > API.body_limit(method, path), f"{method} {path}: dropped"
            return 413, b'{"error": "(refused unread)"}'
        if response.will_close:
            self.connection.close()
        return response.status, reply


@pytest.fixture(scope="module")
def call(agent: AgentProcess) -> Iterator[Caller]:
    caller = Caller(agent)
    yield caller
    caller.connection.close()


def assert_clean(method: str, path: str, body: bytes, status: int, reply: bytes) -> None:
    what = f"{method} {path} {body[:200]!r}"
    assert status < 500, f"{what} -> {status} {reply[:500]!r}"
    if status >= 400:
        error = json.loads(reply)["error"]
        assert isinstance(error, str) and error, what
        assert "\n" not in error and "Traceback" not in error, (what, error)
        assert len(error) <= 1000, (what, error[:300])


@FUZZ
@given(request=REQUESTS)
def test_hostile_bodies_get_clean_refusals(
    agent: AgentProcess, call: Caller, request: tuple[str, str, bytes]
) -> None:
    method, path, body = request
    status, reply = call(method, path, body)
    assert_clean(method, path, body, status, reply)


MONITOR_BASE = {
    "assignment": make_assignment(NODE_ID, nproc_per_node=1).to_json()
    | {"monitor": {"log_rules": [], "progress_pattern": None}}
}


@settings(FUZZ, max_examples=200)
@given(body=mutated(MONITOR_BASE["assignment"]["monitor"]))
def test_hostile_monitor_configs_get_clean_refusals(
    agent: AgentProcess, call: Caller, body: Any
) -> None:
    """The monitor's rules are checked on this agent's own assignment (the first valid
    one starts attempt 0, whose worker exits at once; the same attempt again is a
    retry or refused)."""
    request = json.loads(json.dumps(MONITOR_BASE))
    request["assignment"]["monitor"] = body
    raw = encode(request)
    status, reply = call("POST", "/start", raw)
    assert_clean("POST", "/start", raw, status, reply)


@pytest.mark.parametrize("path", [p for _, p in ROUTES])
@pytest.mark.parametrize(
    "body",
    [
        nested(100_000, "list"),
        b'{"attempt": ' + b"9" * 5000 + b"}",
        b'{"attempt": NaN, "step": Infinity}',
        b'{"a": "\\ud800"}',
        b"\xef\xbb\xbf{}",
        b"   \r\n\t ",
        b"null",
        b'"' + b"x" * (MAX_JSON_BYTES - 2) + b'"',
        b'{"' + b"k" * 100_000 + b'": 1}',
        b'{"a\\nb\\u0000": 1}',
    ],
    ids=[
        "deep",
        "huge-int",
        "nan",
        "lone-surrogate",
        "bom",
        "blank",
        "null",
        "1-MiB-string",
        "long-key",
        "control-key",
    ],
)
def test_edge_bodies_get_clean_refusals(
    agent: AgentProcess, call: Caller, path: str, body: bytes
) -> None:
    method = next(m for m, p in ROUTES if p == path)
    status, reply = call(method, path, body)
    assert_clean(method, path, body, status, reply)
    assert status >= 400


def test_the_agent_still_answers(agent: AgentProcess, tmp_path: Path) -> None:
    assert agent.proc.poll() is None
    assert agent.client.status().node_id == NODE_ID
