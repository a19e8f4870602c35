"""What one node agent costs: the real ``python -m trainguard.agent``, against ``import torch``.

    python -m bench.agent_cost --workdir DIR --repeats 5 --out agent.json

Each repetition spawns the real agent (a token file, ``--port-file``, ``-- true`` as its
workers' command, which it never runs: no ``/start`` comes), and measures:

- ``start_s``: spawn -> its port file exists (it serves its API);
- ``cpu_s``: the CPU time it used to get there (``/proc/<pid>/stat``);
- ``rss_mib``, ``rss_peak_mib``: its resident memory once it serves (``VmRSS``,
  ``VmHWM`` in ``/proc/<pid>/status``).

The baseline, in the same run and interleaved with it: ``python -c "import torch"``,
the least an agent that imports torch pays (its wall time, CPU time and peak resident
memory, from ``wait4``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TOKEN = "bench-agent-cost-token"
SERVE_TIMEOUT = 60.0
POLL_SECONDS = 0.002
METRICS = ("start_s", "cpu_s", "rss_peak_mib")


@dataclass(frozen=True)
class Cost:
    """One process: how long it took, the CPU it used, its memory (MiB)."""

    start_s: float
    cpu_s: float
    rss_peak_mib: float
    rss_mib: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_status(text: str) -> dict[str, int]:
    """The ``kB`` fields of a ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ...), in KiB."""
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[key] = int(parts[0])
    return fields


def parse_cpu_seconds(stat: str, ticks: int) -> float:
    """User + system CPU seconds from a ``/proc/<pid>/stat`` line (``ticks`` per second)."""
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of the whole line
    return (utime + stime) / ticks


def agent_command(
    workdir: Path,
    *,
    node_id: str = "node-0",
    token: str = TOKEN,
    env: dict[str, str] | None = None,
) -> tuple[list[str], Path]:
    """The real agent's command line for a node of its own in ``workdir`` (which gets its
    token file, logs and port file), running ``true``; and the port file it will write."""
    token_file = workdir / "token"
    token_file.write_text(token + "\n")
    port_file = workdir / "agent.port"
    argv = [sys.executable, "-m", "trainguard.agent", "--node-id", node_id]
    argv += ["--incarnation", f"{node_id}.1", "--token-file", str(token_file)]
    argv += ["--log-dir", str(workdir / "logs"), "--port-file", str(port_file)]
    for name, value in (env or {}).items():
        argv += ["--env", f"{name}={value}"]
    return [*argv, "--", "true"], port_file


def measure_agent(workdir: Path) -> Cost:
    """Spawn the real agent, wait until it serves; its cost then (see the docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv, port_file = agent_command(workdir)
    port_file.unlink(missing_ok=True)
    with open(workdir / "agent.log", "ab") as log:
        began = time.perf_counter()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = began + SERVE_TIMEOUT
        while not port_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the agent exited with {process.returncode}; see {log.name}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the agent did not serve within {SERVE_TIMEOUT:g} s")
            time.sleep(POLL_SECONDS)
        start_s = time.perf_counter() - began
        pid = process.pid
        cpu = parse_cpu_seconds(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))
        status = parse_status(Path(f"/proc/{pid}/status").read_text())
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return Cost(start_s, cpu, status["VmHWM"] / 1024, status["VmRSS"] / 1024)


def measure_import_torch() -> Cost:
    """``python -c "import torch"``: wall time, CPU time and peak memory (``wait4``)."""
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", "import torch"], stdin=subprocess.DEVNULL)
    _, code, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - began
    process.returncode = os.waitstatus_to_exitcode(code)
    if process.returncode != 0:
        raise RuntimeError(f"python -c 'import torch' exited with {process.returncode}")
    # ru_maxrss is in KiB on Linux.
    return Cost(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def measure(workdir: Path, repeats: int) -> dict[str, list[Cost]]:
    """``repeats`` of each, interleaved (a slow spell hits both alike)."""
    runs: dict[str, list[Cost]] = {"trainguard": [], "baseline_import_torch": []}
    for rep in range(repeats):
        runs["trainguard"].append(measure_agent(workdir / f"agent-{rep}"))
        runs["baseline_import_torch"].append(measure_import_torch())
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = measure(args.workdir, args.repeats)
    text = json.dumps({k: [c.to_json() for c in v] for k, v in runs.items()}, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
