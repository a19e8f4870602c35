"""The agent's own HTTP server against an aiohttp one serving the same API, like for like.

    python -m bench.agent_http --repeats 4 --polls 2000 --out agent_http.json

Why the agents keep a small server of their own while every other trainguard server is
aiohttp (docs/benchmarks.md, "The agent's HTTP server, measured on its own"). Each
repetition spawns the real agent (``bench.agent_cost.agent_command``) twice, in turn
(the order reversed every other repetition): as it is, and with its server swapped for
:class:`AioAgentServer`, a prototype that serves the same :class:`AgentApi`'s JSON routes
through one aiohttp handler (the replica routes left out, so a real port costs no less).
It measures each one's start (spawn -> serving, its CPU, its resident memory), then
``--polls`` kept-alive ``GET /status`` through ``AgentClient`` (the agent's CPU per
poll), and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from aiohttp import web

from bench.agent_cost import TOKEN, agent_command, parse_cpu_seconds, parse_status
from trainguard.agent.api import AgentApi, NodeControl, error_reply
from trainguard.agent.client import AgentClient
from trainguard.agent.lease import ControllerLease
from trainguard.http_server import RouteServer
from trainguard.netlimits import ConnLimits

AIOHTTP_FLAG = "--aiohttp-agent"
"""Run as ``python -m bench.agent_http --aiohttp-agent AGENT ARGS...``: the agent, its
server swapped for :class:`AioAgentServer`."""


class AioAgentServer:
    """The prototype: :class:`AgentApi` over aiohttp (``RouteServer``), JSON routes only."""

    def __init__(
        self,
        host: str,
        port: int,
        node: NodeControl,
        token: str,
        replicas: object = None,
        lease: ControllerLease | None = None,
        log_root: Path | None = None,
    ) -> None:
        self.api = AgentApi(node, token, lease, log_root)
        routes = [web.route("*", "/{tail:.*}", self._any)]
        self.server = RouteServer(host, port, routes, limits=ConnLimits(64, 64, 10.0))

    async def _any(self, request: web.Request) -> web.Response:
        api, method, path = self.api, request.method, request.path
        reply = None
        if not api.authorized(request.headers.get("Authorization")):
            reply = error_reply(401, "missing or wrong bearer token")
        else:
            reply = api.route(method, path)
        if reply is None:
            if (request.content_length or 0) > api.body_limit(method, path):
                reply = error_reply(413, "body too large")
            else:
                reply = api.handle(method, path, await request.read())
        response = web.Response(
            status=reply.status,
            body=reply.body,
            headers=reply.headers,
            content_type="application/json",
        )
        if reply.after is not None:
            await response.prepare(request)
            await response.write_eof()
            reply.after()
        return response

    @property
    def port(self) -> int:
        return self.server.port

    def start(self) -> None:
        """Serving since construction (``RouteServer`` binds and serves at once)."""

    def stop(self) -> None:
        self.server.close()


def measure(workdir: Path, polls: int, aiohttp: bool) -> dict[str, float]:
    """One agent: its start, then ``polls`` kept-alive status requests."""
    workdir.mkdir(parents=True)
    argv, port_file = agent_command(workdir)
    if aiohttp:  # [python, -m, trainguard.agent, ...] -> this module, swapping the server
        argv = [argv[0], "-m", "bench.agent_http", AIOHTTP_FLAG, *argv[3:]]
    ticks = os.sysconf("SC_CLK_TCK")
    with open(workdir / "agent.log", "ab") as log:
        began = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None:
                raise SystemExit(f"agent exited {proc.returncode}: see {workdir}/agent.log")
            time.sleep(0.002)
        start_s = time.perf_counter() - began
        stat, status = Path(f"/proc/{proc.pid}/stat"), Path(f"/proc/{proc.pid}/status")
        start_cpu = parse_cpu_seconds(stat.read_text(), ticks)
        rss = parse_status(status.read_text())["VmRSS"] / 1024
        client = AgentClient(f"http://127.0.0.1:{int(port_file.read_text().split()[0])}", TOKEN)
        client.status()
        cpu = parse_cpu_seconds(stat.read_text(), ticks)
        for _ in range(polls):
            client.status()
        poll_cpu = parse_cpu_seconds(stat.read_text(), ticks) - cpu
        client.close()
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return {
        "start_s": start_s,
        "cpu_s": start_cpu,
        "rss_mib": rss,
        "poll_cpu_ms_each": 1000 * poll_cpu / polls,
        "threads": threads,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [AIOHTTP_FLAG]:
        import trainguard.agent.server
        from trainguard.agent.__main__ import main as agent_main

        trainguard.agent.server.AgentHTTPServer = AioAgentServer  # type: ignore[misc,assignment]
        return agent_main(args[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args(args)
    variants = {"hand-written": False, "aiohttp": True}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with TemporaryDirectory(prefix="agent-http-") as tmp:
        for rep in range(opts.repeats):
            order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            for name in order:
                runs[name].append(measure(Path(tmp) / f"{name}-{rep}", opts.polls, variants[name]))
    medians: dict[str, Any] = {
        name: {key: round(statistics.median(r[key] for r in rs), 4) for key in rs[0]}
        for name, rs in runs.items()
    }
    print(json.dumps(medians, indent=1))
    if opts.out is not None:
        opts.out.write_text(json.dumps({"runs": runs, "median": medians}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
