"""Running one trainguard job on several namespace hosts (tests/netns_hosts.py): the same
``trainguard run`` on each, each host with its own state directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netns_hosts import Host, NamespaceHosts

REPO = Path(__file__).resolve().parent.parent
TOKEN = "multi-host-test-token-0123456789"


@dataclass
class HostRun:
    host: Host
    proc: subprocess.Popen[Any]
    log: Path
    state: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class HostsJob:
    """One ``trainguard run`` per host; ``runs[0]`` is the controller's."""

    hosts: NamespaceHosts
    runs: list[HostRun] = field(default_factory=list)

    def start(
        self,
        host: Host,
        argv: Sequence[str],
        tmp: Path,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
    ) -> HostRun:
        """``nofile``: the run's descriptor limit (soft and hard, as ``ulimit -n``)."""
        state = tmp / f"state-{host.name}"
        log = tmp / f"{host.name}.log"
        full = {**os.environ, "TRAINGUARD_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
        full.setdefault("TRAINGUARD_TOKEN", TOKEN)
        full.setdefault("TRAINGUARD_ALLOW_PARTITION", "1")  # --inject partition rehearsals
        full.update(env or {})
        with log.open("w") as out:
            proc = self.hosts.popen(
                host,
                [sys.executable, "-m", "trainguard.cli", "run", *argv],
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                preexec_fn=None if nofile is None else lambda: _limit_files(nofile),
            )
        run = HostRun(host, proc, log, state)
        self.runs.append(run)
        return run

    def wait(self, timeout: float = 240.0) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(r.proc.poll() is None for r in self.runs):
            time.sleep(0.2)
        return [r.proc.poll() for r in self.runs]

    def outputs(self) -> str:
        return "\n".join(f"===== {r.host.name}\n{r.output()[-6000:]}" for r in self.runs)

    def describe(self, run: HostRun) -> dict[str, Any]:
        import json

        env = {**os.environ, "TRAINGUARD_STATE_DIR": str(run.state)}
        done = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "list", "-o", "json"],
            env=env, capture_output=True, text=True, check=True, cwd=REPO,
        )  # fmt: skip
        [job] = json.loads(done.stdout)
        done = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "describe", job["id"], "-o", "json"],
            env=env, capture_output=True, text=True, check=True, cwd=REPO,
        )  # fmt: skip
        data: dict[str, Any] = json.loads(done.stdout)
        return data


def _limit_files(count: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))


def endpoint(hosts: NamespaceHosts) -> str:
    return f"{hosts[0].addr}:29500"
