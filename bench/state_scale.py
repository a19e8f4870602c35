"""``state_scale``: recovery at real state sizes, against the link's speed and a relaunch.

One run measures, on 1 node x 2 gloo ranks (DDP + Adam, ``bench/state_scale_train.py``):

- the link: ``send``/``recv`` of 512 MiB (64 MiB with ``--quick``) between two processes,
  as seconds per GB;
- for each per-rank state size (0.04, 0.4, 1.5 and 4 GB, those that fit the machine's
  free memory; 0.04 GB with ``--quick``):

  - ``checkpointless``: ``resilient.loop`` with a hot spare, rank 1 SIGKILLed at
    :data:`KILL_STEP`; the bench plays the agent (announces the next attempt and hands
    rank 1 to the spare as soon as it has killed it, as ``tests/test_resilient_recovery.py``
    does), so the controller's detection is not in these figures. The spare's
    ``joined attempt`` line gives the transfer's phases;
  - ``relaunch``: the same script under plain torchrun's rules, ``torch.save`` of its
    state to ``/dev/shm`` every 5 steps; after the same SIGKILL both ranks are started
    again at once (no launcher's detection either) and resume from their snapshots.

For each: ``stall_s`` (the fault to the next completed step), ``lost_s`` (the fault to
the first step past the last one completed before it: the stall plus the steps redone),
``step_s`` (median before the fault), and the targets of issue 37 as booleans: stall
within 0.5 s + 2 steps + the state at half the link's bandwidth; the transfer at 0.8x
the link or better (judged at 1.5 GB); checkpointless ``lost_s`` within 0.2x the
relaunch's;

  - ``process_level``: the same script under the real ``trainguard run`` with the memory
    tier (snapshots every 5 steps), the same SIGKILL by ``--inject``; the agent restarts
    the workers and they restore from the memory tier. Its figures, and each restarted
    rank's start phases, are :mod:`bench.state_scale_process`'s; ``ratio_lost_process``
    is its ``lost_s`` over the relaunch's.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainguard.resilient.protocol import (
    CONTROL_DIR_ENV,
    SPARE_ID_ENV,
    ResilientAttempt,
    SpareAssignment,
    write_attempt,
    write_spare,
)

REPO = Path(__file__).resolve().parent.parent
TRAIN = Path(__file__).resolve().parent / "state_scale_train.py"
SIZES_GB = (0.04, 0.4, 1.5, 4.0)
QUICK_SIZES_GB = (0.04,)
KILL_STEP = 12  # two steps after the relaunch's snapshot at step 10
STEPS = 16
LINK_BYTES = 512 << 20
QUICK_LINK_BYTES = 64 << 20
MEMORY_PER_STATE = 7.0
"""Bytes of free memory a size needs per byte of state: the process-level run's 2 ranks
with state and gradients and their 4 memory-tier slots in /dev/shm (the checkpointless
run's 3 processes and the relaunch's snapshots need less)."""
_TRANSFER = re.compile(
    r"state from peer rank \d+(?: with ranks [\d,]+)? at step \d+ "
    r"\(([\d.]+) MB in ([\d.]+) s: layout ([\d.]+) s, "
    r"data ([\d.]+) s \(([\d.]+) GB/s\), load ([\d.]+) s\)"
)
_JOINED = re.compile(
    r"joined attempt 1 \(world \d+\) in ([\d.]+) s \(group ([\d.]+) s, set-up ([\d.]+) s, "
    r"state ([\d.]+) s\)"
)

_LINK_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    n = int(sys.argv[1])
    data = torch.ones(n, dtype=torch.uint8)
    warm = torch.ones(1 << 20, dtype=torch.uint8)
    best = None
    for _ in range(3):
        dist.barrier()
        if dist.get_rank() == 0:
            dist.send(warm, 1); began = time.perf_counter(); dist.send(data, 1)
            dist.recv(warm[:1], 1)
        else:
            dist.recv(warm, 0); began = time.perf_counter(); dist.recv(data, 0)
            dist.send(warm[:1], 0)
        took = time.perf_counter() - began
        best = took if best is None else min(best, took)
    if dist.get_rank() == 1:
        print(best)
    dist.destroy_process_group()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TRAINGUARD_")
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"))
    env.update(extra)
    return env


def _rank_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    return _env(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


class Procs:
    """The processes of one run, torn down by pid whatever happens."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: Sequence[str], env: dict[str, str]) -> None:
        log = open(self.out / f"{name}.log", "ab")  # noqa: SIM115  # the child owns it
        self.procs[name] = subprocess.Popen(
            [sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )

    def wait(self, names: Sequence[str], timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.procs[n].poll() is None for n in names):
            time.sleep(0.1)
        return [self.procs[n].poll() for n in names]

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text(errors="replace")


def link_seconds_per_gb(workdir: Path, nbytes: int) -> float:
    """Seconds per GB of one gloo send/recv of ``nbytes`` between two processes (best of 3)."""
    procs = Procs(workdir)
    port = free_port()
    try:
        for rank in (0, 1):
            procs.start(f"link-{rank}", ["-c", _LINK_SCRIPT, str(nbytes)], _rank_env(rank, port))
        codes = procs.wait(["link-0", "link-1"], 300)
    finally:
        procs.close()
    if codes != [0, 0]:
        raise RuntimeError(f"link measurement failed: {procs.log('link-1')[-2000:]}")
    seconds = float(procs.log("link-1").strip().splitlines()[-1])
    return seconds / (nbytes / 1e9)


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _wait_step(out: Path, step: int, procs: Procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(s["step"] >= step for s in _steps(out)):
        ended = [name for name, proc in procs.procs.items() if proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"{', '.join(ended)} ended" if ended else f"not reached in {timeout:.0f} s"
            raise RuntimeError(f"step {step} {why}: {procs.log('rank-0')[-3000:]}")
        time.sleep(0.05)


def _figures(out: Path, fault_at: float, first_pid: int) -> dict[str, Any]:
    """stall, lost time and step time from rank 0's step records."""
    records = _steps(out)
    before = [r for r in records if r["time"] < fault_at]
    done = max(r["step"] for r in before)
    after = [r for r in records if r["time"] >= fault_at]
    times = [b["time"] - a["time"] for a, b in itertools.pairwise(before)]
    past = [r for r in after if r["step"] > done]
    return {
        "completed_before_fault": done,
        "stall_s": min(r["time"] for r in after) - fault_at if after else None,
        "lost_s": past[0]["time"] - fault_at if past else None,
        "steps_redone": sum(1 for r in after if r["step"] <= done),
        "step_s": statistics.median(times[2:] or times) if times else None,
        "survivor_kept": bool(after) and after[0]["pid"] == first_pid,
    }


def checkpointless(workdir: Path, state_gb: float, timeout: float) -> dict[str, Any]:
    """One checkpointless recovery with a hot spare (see the module doc)."""
    out = workdir / f"checkpointless-{state_gb}"
    control = out / "control"
    control.mkdir(parents=True)
    procs = Procs(out)
    argv = [str(TRAIN), "--out", str(out), "--state-gb", str(state_gb), "--steps", str(STEPS)]
    port = free_port()
    write_attempt(
        control,
        ResilientAttempt(
            attempt=0,
            master_addr="127.0.0.1",
            master_port=port,
            world_size=2,
            barrier_timeout_seconds=timeout,
        ),
    )
    try:
        for rank in (0, 1):
            env = _rank_env(rank, port, TRAINGUARD_ATTEMPT="0", **{CONTROL_DIR_ENV: str(control)})
            procs.start(f"rank-{rank}", argv, env)
        procs.start("spare", argv, _env(**{CONTROL_DIR_ENV: str(control), SPARE_ID_ENV: "0"}))
        _wait_step(out, KILL_STEP, procs, timeout)
        first_pid = procs.procs["rank-0"].pid
        procs.kill("rank-1")
        fault_at = time.time()
        write_attempt(
            control,
            ResilientAttempt(
                attempt=1,
                master_addr="127.0.0.1",
                master_port=free_port(),
                world_size=2,
                barrier_timeout_seconds=timeout,
            ),
        )
        write_spare(control, 0, SpareAssignment(rank=1, local_rank=1, attempt=1))
        codes = procs.wait(["rank-0", "spare"], timeout)
    finally:
        procs.close()
    if codes != [0, 0]:
        raise RuntimeError(f"checkpointless run failed {codes}: {procs.log('spare')[-3000:]}")
    result = _figures(out, fault_at, first_pid)
    spare = procs.log("spare")
    found = _TRANSFER.search(spare)
    if found:
        mb, total, layout, data, rate, load = (float(g) for g in found.groups())
        result["transfer"] = {
            "gb": mb / 1e3,
            "total_s": total,
            "layout_s": layout,
            "data_s": data,
            "gb_per_s": rate,
            "load_s": load,
        }
    for name, log in (("spare", spare), ("survivor", procs.log("rank-0"))):
        joined = _JOINED.search(log)
        if joined:  # its join's phases: the group, the script's set-up (a spare's model), state
            total, group, setup, state = (float(g) for g in joined.groups())
            result[f"{name}_join"] = {
                "total_s": total,
                "group_s": group,
                "setup_s": setup,
                "state_s": state,
            }
    return result


def relaunch(workdir: Path, state_gb: float, timeout: float) -> dict[str, Any]:
    """The same fault, recovered by starting both ranks again from /dev/shm snapshots."""
    out = workdir / f"relaunch-{state_gb}"
    out.mkdir(parents=True)
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else out) / f"tg-state-scale-{os.getpid()}"
    shm.mkdir(parents=True, exist_ok=True)
    argv = [
        str(TRAIN),
        "--out",
        str(out),
        "--state-gb",
        str(state_gb),
        "--steps",
        str(STEPS),
        "--mode",
        "relaunch",
        "--snapshot-dir",
        str(shm),
    ]
    procs = Procs(out)
    try:
        port = free_port()
        for rank in (0, 1):
            procs.start(f"rank-{rank}", argv, _rank_env(rank, port))
        _wait_step(out, KILL_STEP, procs, timeout)
        first_pid = procs.procs["rank-0"].pid
        procs.kill("rank-1")
        fault_at = time.time()
        procs.kill("rank-0")  # torchrun stops the group on a worker's failure
        port = free_port()
        for rank in (0, 1):
            procs.start(f"again-{rank}", argv, _rank_env(rank, port))
        codes = procs.wait(["again-0", "again-1"], timeout)
    finally:
        procs.close()
        for path in shm.glob("*"):
            path.unlink()
        shm.rmdir()
    if codes != [0, 0]:
        raise RuntimeError(f"relaunch failed {codes}: {procs.log('again-0')[-3000:]}")
    return _figures(out, fault_at, first_pid)


def sizes_that_fit(sizes: Sequence[float]) -> list[float]:
    """The sizes whose runs fit the machine's available memory."""
    available = 0.0
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024 / 1e9
    return [gb for gb in sizes if gb * MEMORY_PER_STATE <= available]


def targets(size: dict[str, Any], link_s_per_gb: float, gb: float) -> dict[str, bool | None]:
    """Issue 37's targets for one size (None where a figure is missing)."""
    ours, theirs = size["checkpointless"], size["relaunch"]
    stall, step = ours.get("stall_s"), ours.get("step_s")
    transfer = ours.get("transfer") or {}
    bound = None if step is None else 0.5 + 2 * step + gb * 2 * link_s_per_gb
    rate = transfer.get("gb_per_s")
    return {
        "stall_within_bound": None if stall is None or bound is None else stall <= bound,
        "transfer_at_0.8x_link": None if rate is None else rate >= 0.8 / link_s_per_gb,
        "lost_within_0.2x_relaunch": (
            None
            if ours.get("lost_s") is None or theirs.get("lost_s") is None
            else ours["lost_s"] <= 0.2 * theirs["lost_s"]
        ),
    }


def measure(quick: bool, workdir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The scenario's results (see the module doc)."""
    workdir.mkdir(parents=True, exist_ok=True)
    timeout = 600.0
    link = link_seconds_per_gb(workdir, QUICK_LINK_BYTES if quick else LINK_BYTES)
    log(f"state_scale: link {1 / link:.2f} GB/s ({link:.3f} s/GB)")
    wanted = QUICK_SIZES_GB if quick else SIZES_GB
    sizes = sizes_that_fit(wanted)
    result: dict[str, Any] = {
        "link_s_per_gb": link,
        "link_gb_per_s": 1 / link,
        "skipped_sizes_gb": [gb for gb in wanted if gb not in sizes],
        "sizes": {},
    }
    from bench.state_scale_process import process_level  # it imports this module

    sides: dict[str, Callable[[Path, float, float], dict[str, Any]]] = {
        "checkpointless": checkpointless,
        "process_level": process_level,
        "relaunch": relaunch,
    }
    for gb in sizes:
        size: dict[str, Any] = {}
        for name, run in sides.items():
            try:
                size[name] = run(workdir, gb, timeout)
            except RuntimeError as exc:  # one side's failure (out of memory) ends only it
                log(f"state_scale {gb} GB {name} failed: {str(exc)[:2000]}")
                size[name] = {"error": str(exc)[-2000:]}
        ours = size["checkpointless"]
        if ours.get("stall_s") is not None:
            ours["stall_s_per_gb"] = ours["stall_s"] / gb
        size["targets"] = targets(size, link, gb)
        theirs = size["relaunch"].get("lost_s")
        for key, side in (("ratio_lost", ours), ("ratio_lost_process", size["process_level"])):
            size[key] = side["lost_s"] / theirs if side.get("lost_s") and theirs else None
        result["sizes"][str(gb)] = size
        log(f"state_scale {gb} GB: {json.dumps(size)}")
    return result
