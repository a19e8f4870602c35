"""The slurm benchmark's pure parts: the baseline's batch script (run by sh against fake
``srun``/``scontrol``/python that record what they were given) and the table's rows. The
real-Slurm run is ``python -m bench --only slurm`` (``make bench``), not a test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.runs import TrainArgs
from bench.slurm import TORCHRUN_PORT, torchrun_script
from bench.slurm_rows import BASELINE, slurm_rows

FAKE_SRUN = """#!/bin/sh
# srun: its own options first, then the task, run here as node 1 of the job
while [ "${1#--}" != "$1" ]; do echo "$1" >> "$RECORD.srun"; shift; done
SLURM_NODEID=1 exec "$@"
"""
FAKE_SCONTROL = """#!/bin/sh
printf 'hostA\\nhostB\\n'
"""
FAKE_PYTHON = """#!/bin/sh
# one JSON line: the arguments and the node rank torchrun would read (PET_NODE_RANK)
printf '%s\\n' "$@" > "$RECORD.argv"
echo "$PET_NODE_RANK $GLOO_SOCKET_IFNAME" > "$RECORD.env"
"""


def _fake(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_the_requeue_baseline_script_starts_torchrun_per_node_with_each_run_its_own_id(
    tmp_path: Path,
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", FAKE_SRUN)
    _fake(bin_dir, "scontrol", FAKE_SCONTROL)
    python = _fake(bin_dir, "fake-python", FAKE_PYTHON)
    args = TrainArgs(steps=60, step_sleep=0.1)
    script = tmp_path / "job.sh"
    script.write_text(
        torchrun_script(args, tmp_path / "out", tmp_path / "ck pt", "eth9", str(python))
    )
    record = tmp_path / "rec"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORD": str(record),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "host[A-B]",
        "SLURM_RESTART_COUNT": "2",
    }
    subprocess.run(["sh", str(script)], env=env, check=True, timeout=30)
    argv = Path(f"{record}.argv").read_text().splitlines()
    assert argv[:2] == ["-m", "torch.distributed.run"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--master-addr") == "hostA"  # the job's first node
    assert flag("--master-port") == str(TORCHRUN_PORT + 2)  # a port per Slurm run
    assert flag("--rdzv-id") == "slurm7r2"  # the steps' incarnation per Slurm run
    assert flag("--nnodes") == "2" and flag("--ckpt") == "torch"
    assert flag("--ckpt-dir") == str(tmp_path / "ck pt")  # quoted through sh
    assert argv.index("--rdzv-id") < argv.index(str(Path("bench/train.py").resolve()))
    assert Path(f"{record}.env").read_text().split() == ["1", "eth9"]  # SLURM_NODEID
    srun = Path(f"{record}.srun").read_text().split()
    assert "--nodes=2" in srun and "--no-kill" not in srun  # Slurm's default: kill


def _side(values: list[float], runs: int = 3) -> dict[str, Any]:
    stats = {
        "median": sorted(values)[len(values) // 2],
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "runs": runs,
    }
    return {m: stats for m in ("stall_s", "lost_steps", "detect_s")} | {
        "recovered": len(values),
        "runs": [{"note": ""}] * runs,
    }


def test_the_rows_compare_trainguard_with_slurm_s_requeue_and_say_why_when_skipped() -> None:
    lost = {
        "setup": {"cap_s": 30.0, "capped_baselines": []},
        "trainguard": _side([20.0, 21.0, 22.0]),
        "baseline_requeue": _side([40.0, 42.0, 44.0]),
        "ratio": {f"{m}_vs_baseline_requeue": 0.5 for m in ("stall_s", "lost_steps", "detect_s")},
    }
    rows = slurm_rows({"setup": {}, "lost": lost})
    assert [r.metric.split(": ")[1] for r in rows] == [
        "stall",
        "steps lost (redone)",
        "cut -> NodeLost / Slurm's requeue",
    ]
    assert {r.baseline for r in rows} == {BASELINE}
    assert rows[0].ours == "21.0 s (20.0 s-22.0 s)" and rows[0].ratio == "0.50x"
    assert rows[0].verdict == "trainguard better"
    [skipped] = slurm_rows({"skipped": "not root"})
    assert skipped.verdict == "not measured: not root"
    assert json.dumps([r.__dict__ for r in rows])  # plain data, for results.md
