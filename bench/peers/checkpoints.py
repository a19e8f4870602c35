"""Save blocking and restore: trainguard's memory tier against the checkpointing peers.

Each repetition runs every side once, interleaved, each in its own process on the same
state (``--mib`` MiB of float32 in 4 tensors): ``trainguard_ckpt`` in the project's
environment; in the peers', ``sagemaker_ckpt.py`` with the library's in-memory service
stand-in serving beside it, and ``dlrover_ckpt.py``. A side's figures are the medians
over every save and restore of every repetition.
"""

from __future__ import annotations

import json
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from bench.baseline import free_port
from bench.peers.env import PeerEnv
from bench.peers.procs import PEERS_DIR, Procs
from bench.report import summary
from bench.runs import REPO


def _sagemaker(env: PeerEnv, workdir: Path, mib: int, saves: int) -> dict[str, Any]:
    procs = Procs(workdir / "logs")
    port = free_port()
    out = workdir / "sagemaker.json"
    serve = (
        "import sys; sys.path.insert(0, sys.argv[1]); import uvicorn; "
        "from membrain_server import app; "
        "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')"
    )
    try:
        procs.start("membrain", [env.python, "-c", serve, str(env.membrain.parent), str(port)])
        if not _listening(port, 120.0):
            return {"error": f"the stand-in did not listen: {procs.log_tail('membrain')}"}
        argv = [env.python, "-W", "ignore", str(PEERS_DIR / "sagemaker_ckpt.py")]
        argv += ["--membrain-port", str(port), "--mib", str(mib), "--repeats", str(saves)]
        procs.start("save", [*argv, "--out", str(out)])
        if not procs.wait_all(["save"], 600.0) or not out.exists():
            return {"error": f"sagemaker_ckpt.py failed: {_error_line(procs, 'save')}"}
    finally:
        procs.stop()
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _dlrover(env: PeerEnv, workdir: Path, mib: int, saves: int) -> dict[str, Any]:
    procs = Procs(workdir / "logs")
    out = workdir / "dlrover.json"
    argv = [env.python, "-W", "ignore", str(PEERS_DIR / "dlrover_ckpt.py"), "--mib", str(mib)]
    argv += ["--repeats", str(saves), "--dir", str(workdir / "ckpt"), "--out", str(out)]
    try:
        procs.start("save", argv)
        ok = procs.wait_all(["save"], 600.0)
    finally:
        procs.stop()
    if not ok or not out.exists():
        return {"error": f"dlrover_ckpt.py failed: {_error_line(procs, 'save')}"}
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _error_line(procs: Procs, name: str) -> str:
    """The log's last line naming an error (else its tail)."""
    path = procs.logs / f"{name}.log"
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    errors = [ln.strip() for ln in text.splitlines() if "Error:" in ln]
    return errors[0] if errors else procs.log_tail(name)


def _trainguard(workdir: Path, mib: int, saves: int) -> dict[str, Any]:
    procs = Procs(workdir / "logs")
    out = workdir / "trainguard.json"
    memory = Path("/dev/shm") / f"tg-bench-peers-{workdir.name}-{time.time_ns()}"
    argv = [sys.executable, "-m", "bench.peers.trainguard_ckpt", "--mib", str(mib)]
    argv += ["--repeats", str(saves), "--dir", str(memory), "--out", str(out)]
    try:
        procs.start("trainguard", argv, env={"PYTHONPATH": str(REPO)})
        ok = procs.wait_all(["trainguard"], 600.0)
    finally:
        procs.stop()
        shutil.rmtree(memory, ignore_errors=True)
    if not ok or not out.exists():
        return {"error": f"trainguard_ckpt failed: {procs.log_tail('trainguard')}"}
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def _listening(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.2)
    return False


def measure(
    env: PeerEnv, workdir: Path, mib: int, repeats: int, saves: int, log: Any
) -> dict[str, Any]:
    """``{side: {save_s, restore_s (summaries), identical, runs}}`` for trainguard and
    each checkpointing peer the environment has (a skipped one: ``{"skipped": why}``)."""
    sides: dict[str, Any] = {"trainguard_memory": []}
    sides |= {peer: [] for peer in PEERS if env.has(peer)}
    for rep in range(repeats):
        for side, runs in sides.items():
            where = workdir / f"{side}-{rep}"
            if side == "trainguard_memory":
                run = _trainguard(where, mib, saves)
            else:
                run = PEERS[side](env, where, mib, saves)
            log(f"peers checkpoint {rep + 1}/{repeats} {side}: {run}")
            runs.append(run)
    result: dict[str, Any] = {side: figures(runs) for side, runs in sides.items()}
    for peer in PEERS:
        if not env.has(peer):
            result[peer] = {"skipped": env.skipped.get(peer, "not installed")}
    return result


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every save and restore of the runs that worked; a side none of whose
    runs worked is ``{"skipped": <the first run's error>, "runs": ...}``."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"skipped": runs[0]["error"] if runs else "not run", "runs": runs}
    return {
        "save_s": summary([s for r in good for s in r["save_s"]]),
        "restore_s": summary([s for r in good for s in r["restore_s"]]),
        "identical": all(r["identical"] for r in good),
        "runs": runs,
    }


PEERS = {"sagemaker": _sagemaker, "dlrover": _dlrover}
