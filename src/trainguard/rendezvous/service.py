"""The job's rendezvous store service: every attempt's TCPStore, served outside the ranks.

``python -m trainguard.rendezvous.service --state FILE --owner PID --grace S [--host ADDR
--peers-file FILE]`` runs on the controller's host for as long as the job does. For each
attempt the controller asks it (``POST /open``) for a fresh ``torch.distributed.TCPStore``
(``is_master=True``, libuv, on loopback), reached through the service's door at
``--host`` (:mod:`.gateway`: only the job's hosts get in); the attempt's workers get
``TORCHELASTIC_USE_AGENT_STORE=True`` and ``MASTER_ADDR``/``MASTER_PORT`` pointing at
it, so every rank, rank 0 too, connects as a client
(``torch.distributed.rendezvous._create_c10d_store``), torchrun's convention for an
agent-hosted store. The store is up before any worker starts: no rank waits for rank
0 to bind, and a rank 0 (or node 0) that is killed and replaced finds the same endpoint
with its keys. A fresh store per attempt (not one store with a prefix, which unmodified
scripts would not add) keeps an attempt from reading a previous attempt's peer addresses.

Control is HTTP on loopback, each request carrying the service's token as its bearer
token (:mod:`trainguard.auth`): ``POST /open {"attempt": N}`` -> ``{"port": P, "next": Q}`` (the
same port for the same attempt; attempt N+1's store is opened ahead, so that the next
``/open`` is not waited for; attempts older than N-1 are closed), ``POST /attach {"pid": P,
"start": T}`` (a resumed controller takes it over), ``POST /shutdown``, ``GET /health``.
The service lives while its owner does, and ``--grace`` seconds after (the node agents'
grace, ``controllerGraceSeconds``), so that ``trainguard resume`` finds it with the running
attempt's store intact. It writes ``{"pid", "started", "control_port"}`` to ``--state``
once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from trainguard.agent.controller_watch import ControllerWatch
from trainguard.auth import bearer_ok
from trainguard.http_server import RouteServer
from trainguard.netlimits import conn_limits, raise_nofile
from trainguard.rendezvous.gateway import Gateway
from trainguard.rendezvous.output import LOG_MAX_BYTES, capture_output

__all__ = ["TOKEN_ENV", "StoreService", "main"]

TOKEN_ENV = "TRAINGUARD_STORE_TOKEN"
KEEP_ATTEMPTS = 2  # the newest attempt's store and the one before (its ranks may linger)
MAX_BODY = 4096
POSTS = ("/open", "/attach", "/shutdown")


class StoreService:
    """The attempts' stores (in this process), each behind the :class:`Gateway`; thread-safe."""

    def __init__(self, gateway: Gateway) -> None:
        self._lock = threading.Lock()
        self._gateway = gateway
        # attempt -> (its loopback socket, its TCPStore, the port the ranks are given)
        self._stores: dict[int, tuple[socket.socket, Any, int]] = {}

    def open(self, attempt: int) -> tuple[int, int]:
        """The ports of ``attempt``'s store and of the next attempt's, each created on
        first ask (the next one ahead of time: its controller need not wait for it);
        drops the stores of attempts before the previous one."""
        with self._lock:
            ports = self._port(attempt), self._port(attempt + 1)
            for old in [a for a in self._stores if a <= attempt - KEEP_ATTEMPTS]:
                sock, store, _ = self._stores.pop(old)
                self._gateway.close_door(int(store.port))
                del store  # the TCPStore's server stops with its last reference
                sock.close()
            return ports

    def _port(self, attempt: int) -> int:
        import torch.distributed as dist  # imported at start-up (main); cheap here

        entry = self._stores.get(attempt)
        if entry is None:
            # torch's TCPStore binds every interface unless given a bound socket.
            sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
            try:
                store = dist.TCPStore(
                    "127.0.0.1",
                    sock.getsockname()[1],
                    1,
                    is_master=True,
                    wait_for_workers=False,
                    use_libuv=True,
                    master_listen_fd=sock.fileno(),
                )
                door = self._gateway.open(int(store.port))
            except BaseException:
                sock.close()
                raise
            entry = self._stores[attempt] = (sock, store, door)
        return entry[2]

    def attempts(self) -> dict[int, int]:
        with self._lock:
            return {a: door for a, (_, _, door) in self._stores.items()}

    def close(self) -> None:
        with self._lock:
            self._stores.clear()


def _routes(
    service: StoreService, watch: ControllerWatch, token: str, stop: threading.Event
) -> list[web.RouteDef]:
    def reply(code: int, body: dict[str, Any]) -> web.Response:
        return web.json_response(body, status=code)

    def refused(request: web.Request) -> web.Response | None:
        if bearer_ok(request.headers.get("Authorization"), token):
            return None
        return reply(401, {"error": "bad or missing token"})

    async def health(request: web.Request) -> web.Response:
        if (no := refused(request)) is not None:
            return no
        attempts = {str(a): p for a, p in service.attempts().items()}
        return reply(200, {"pid": os.getpid(), "owner": watch.pid, "attempts": attempts})

    async def post(request: web.Request) -> web.Response:
        if (no := refused(request)) is not None:
            return no
        path = request.path
        try:
            body = json.loads(await request.read() or b"{}")
            if not isinstance(body, dict):
                raise ValueError("not an object")
            if path == "/open":
                attempt = body["attempt"]
                if not isinstance(attempt, int) or attempt < 0:
                    raise ValueError("attempt: expected an integer >= 0")
                port, upcoming = await asyncio.to_thread(service.open, attempt)
                return reply(200, {"port": port, "next": upcoming})
            if path == "/attach":
                pid, start = body["pid"], body.get("start")
                if not isinstance(pid, int) or pid < 1:
                    raise ValueError("pid: expected an integer >= 1")
                if start is not None and not isinstance(start, int):
                    raise ValueError("start: expected an integer")
                watch.attach(pid, start)
                return reply(200, {"attached": pid})
            stop.set()  # /shutdown
            watch.wakeup.wake()
            return reply(200, {"stopping": True})
        except (KeyError, ValueError) as exc:
            return reply(400, {"error": f"bad request: {exc}"})
        except (OSError, RuntimeError) as exc:  # cannot listen (out of descriptors?)
            return reply(503, {"error": f"cannot open a store: {exc}"})

    return [web.get("/health", health), *(web.post(p, post) for p in POSTS)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.rendezvous.service")
    parser.add_argument("--state", type=Path, required=True, help="where to write pid and port")
    parser.add_argument("--owner", type=int, required=True, help="the controller's pid")
    parser.add_argument("--grace", type=float, default=0.0, help="s to outlive the owner")
    parser.add_argument("--host", default="127.0.0.1", help="the address ranks reach stores at")
    parser.add_argument("--peers-file", type=Path, help="JSON list of the job hosts' addresses")
    args = parser.parse_args(argv)
    raise_nofile()
    finish_output = capture_output(LOG_MAX_BYTES)
    try:
        return _serve(args)
    finally:
        finish_output()


def _serve(args: argparse.Namespace) -> int:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"{TOKEN_ENV} is not set", file=sys.stderr)
        return 2
    import torch.distributed  # noqa: F401 - the slow part, before saying we listen

    gateway = Gateway(args.host, args.peers_file, limits=conn_limits(1024, 8192))
    service, stop = StoreService(gateway), threading.Event()
    watch = ControllerWatch(args.owner, args.grace)
    routes = _routes(service, watch, token, stop)
    server = RouteServer("127.0.0.1", 0, routes, max_body=MAX_BODY, name="control")
    from trainguard.platform.procs import start_time

    state = {"pid": os.getpid(), "started": start_time(os.getpid()), "control_port": 0}
    state["control_port"] = server.port
    tmp = args.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(args.state)
    try:
        # Asleep until the owner ends, another attaches or /shutdown comes: no tick.
        while not stop.is_set():
            if (why := watch.expired()) is not None:
                print(f"rendezvous store service: {why}; exiting", file=sys.stderr)
                break
            watch.wait()
    finally:
        watch.close()
        watch.wakeup.close()
        server.close()
        service.close()
        gateway.close()
        with contextlib.suppress(OSError):
            if json.loads(args.state.read_text()).get("pid") == os.getpid():
                args.state.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
