"""An unmodified torchrun DDP script runs under trainguard as it does under torchrun."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SCRIPTS, Trainguard

pytestmark = pytest.mark.e2e
SCRIPT = SCRIPTS / "ddp_script.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def by_rank(lines: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in lines:
        m = re.match(r"rank (\d+): ", line)
        if m:
            out.setdefault(int(m.group(1)), []).append(line)
    return out


def torchrun_two_nodes(log_dir: Path) -> list[str] | None:
    """torchrun on 2 'nodes' of this machine (two agents, static rendezvous).

    Its workers share the terminal without line discipline, so their output is
    read from torchrun's own per-rank log files (``--redirects 3``). Returns
    None when torchrun itself failed: its two-agent static rendezvous on one
    host occasionally aborts rank 0 here, which is torchrun's flake, not ours.
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--log-dir",
                str(log_dir / f"node{node}"),
                "--redirects",
                "3",
                str(SCRIPT),
                "--steps",
                "5",
                "--tag",
                "x",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for node in (0, 1)
    ]
    errors = [
        err for proc in procs for _, err in [proc.communicate(timeout=240)] if proc.returncode
    ]
    if errors:
        return None
    return [
        line for f in sorted(log_dir.rglob("stdout.log")) for line in f.read_text().splitlines()
    ]


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_same_env_contract_and_same_output_as_torchrun(
    tg: Trainguard, tmp_path: Path, start: str
) -> None:
    """Warm (workers forked from the agent's template) and cold (fresh interpreters)."""
    for trial in range(3):
        baseline = torchrun_two_nodes(tmp_path / f"torchrun{trial}")
        if baseline is not None:
            break
    assert baseline is not None, "torchrun failed three times"
    expected = by_rank(baseline)
    assert sorted(expected) == [0, 1, 2, 3]
    done = tg.run(
        "run",
        *(["--cold-start"] if start == "cold" else []),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--steps",
        "5",
        "--tag",
        "x",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # trainguard prefixes each line with [rankN]: ; the lines themselves are the script's.
    got_lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in done.stdout.splitlines()]
    got = by_rank(got_lines)
    assert sorted(got) == [0, 1, 2, 3]
    for rank in range(4):
        assert f"rank {rank}: missing env: []" in got[rank]
        assert sorted(got[rank]) == sorted(expected[rank])
