"""Group (re)formation: the job's store service against a TCPStore on rank 0, same run.

``python -m bench --only group_start`` (``make bench`` runs it too). For each world size
(4, 8, 16, 32) a pool of light ranks (``python -m bench.group_start --rank``: torch
imported, nothing else) is started once and kept; then, round after round, every rank is
told a new attempt's store and forms the attempt's default group: ``init_process_group
("gloo", "env://")`` through a first ``all_reduce``, then ``destroy_process_group``: the
re-formation an in-process restart (or a hot spare taking a lost rank's place) does.
Two ways to find the store, interleaved round by round:

- ``trainguard``: the job's store service (:mod:`trainguard.rendezvous`) opens the
  attempt's store (``POST /open``, counted) and every rank joins it as a client
  (``TORCHELASTIC_USE_AGENT_STORE=True``), as trainguard's workers do;
- ``baseline_rank0_store``: torch's ``env://`` default, as trainguard did before: rank 0
  hosts a fresh TCPStore on a fresh port (``TORCHELASTIC_USE_AGENT_STORE=False``), the
  others connect to it.

A round's time is from the moment the driver starts it (before it opens the store or
picks the port) to the last rank's ``all_reduce`` returning (wall clocks of one machine).
The first round of each side at each size is a warm-up, not counted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
WORLDS: tuple[int, ...] = (4, 8, 16, 32)
ROUNDS = 7  # counted rounds per side and world size (after one warm-up each)
QUICK_ROUNDS = 2
SIDES = ("trainguard", "baseline_rank0_store")
TARGET_RATIO = 0.5  # at the largest world
RANK0_LATE_S = 0.25  # the second measure: rank 0 (replaced) arrives this much later
METRICS = {"reform_s": 0.0, "reform_rank0_late_s": RANK0_LATE_S}


class Pool:
    """``world`` light ranks, each waiting on its stdin for a round to form."""

    def __init__(self, world: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.world = world
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.group_start", "--rank", str(rank), str(world)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
                cwd=REPO,
            )
            for rank in range(world)
        ]
        for proc in self.procs:  # each says "ready" once torch is imported
            _expect(proc, "ready")

    def round(self, addr: str, port: int, agent_store: bool, started: float, late: float) -> float:
        """Every rank forms the group; rank 0 starts ``late`` seconds after the others."""
        for rank, proc in enumerate(self.procs):
            order = {"addr": addr, "port": port, "agent_store": agent_store}
            order["delay"] = late if rank == 0 else 0.0
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(order) + "\n")
            proc.stdin.flush()
        done = [json.loads(_expect(proc, "{")) for proc in self.procs]
        return max(float(d["t"]) for d in done) - started

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _expect(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        proc.kill()
        raise RuntimeError(f"rank said {line!r} (exit {proc.poll()}), expected {prefix!r}...")
    return line


def measure(worlds: Sequence[int], rounds: int, workdir: Path, log: Any = print) -> dict[str, Any]:
    """Both sides at each world size, interleaved; see the module docstring."""
    from trainguard.platform.procs import free_port
    from trainguard.rendezvous.client import start_service

    workdir.mkdir(parents=True, exist_ok=True)
    service = start_service(workdir / "rendezvous.json", "bench", 0.0, workdir / "service.log")
    attempt = 0
    runs: dict[str, dict[str, dict[str, list[float]]]] = {
        s: {m: {} for m in METRICS} for s in SIDES
    }
    try:
        for world in worlds:
            started = time.monotonic()
            pool = Pool(world)
            log(f"group_start: {world} ranks ready in {time.monotonic() - started:.1f} s")
            try:
                for index in range(rounds + 1):
                    for metric, late in METRICS.items():
                        for side in SIDES if index % 2 == 0 else reversed(SIDES):
                            attempt += 1
                            began = time.time()
                            if side == "trainguard":
                                port = service.open(attempt)
                                if port is None:
                                    raise RuntimeError(f"store service: {service.failed}")
                            else:
                                port = free_port("127.0.0.1")
                            took = pool.round("127.0.0.1", port, side == "trainguard", began, late)
                            if index > 0:  # round 0 is a warm-up
                                runs[side][metric].setdefault(str(world), []).append(took)
                for metric in METRICS:
                    medians = [_median(runs[s][metric][str(world)]) for s in SIDES]
                    log(
                        f"group_start: world {world} {metric}: "
                        + ", ".join(f"{s} {m:.3f} s" for s, m in zip(SIDES, medians, strict=True))
                    )
            finally:
                pool.close()
    finally:
        service.shutdown()
    return _result(worlds, rounds, runs)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _result(
    worlds: Sequence[int], rounds: int, runs: dict[str, dict[str, dict[str, list[float]]]]
) -> dict[str, Any]:
    from bench.report import summary

    result: dict[str, Any] = {
        "setup": {
            "worlds": list(worlds),
            "rounds": rounds,
            "warmup_rounds": 1,
            "backend": "gloo (loopback)",
            "what": "running ranks form a new attempt's group: init_process_group(env://) "
            "through a first all_reduce",
            "rank0_late_s": RANK0_LATE_S,
        }
    }
    for side in SIDES:
        result[side] = {
            metric: {str(w): summary(runs[side][metric].get(str(w), [])) for w in worlds}
            for metric in METRICS
        }
        result[side]["runs"] = runs[side]
    result["ratio"] = {}
    small, big = str(worlds[0]), str(worlds[-1])
    scale = int(big) / int(small)
    result["growth_exponent"] = {}  # 1: linear in the world size
    for metric in METRICS:
        ratios: dict[str, float | None] = {}
        for w in worlds:
            ours = result["trainguard"][metric][str(w)]["median"]
            theirs = result["baseline_rank0_store"][metric][str(w)]["median"]
            ratios[str(w)] = ours / theirs if ours is not None and theirs else None
        result["ratio"][metric] = ratios
        growth: dict[str, float | None] = {}
        for side in SIDES:
            a = result[side][metric][small]["median"]
            b = result[side][metric][big]["median"]
            growth[side] = math.log(b / a) / math.log(scale) if a and b and scale > 1 else None
        result["growth_exponent"][metric] = growth
    result["target"] = {"ratio_at": int(big), "ratio_max": TARGET_RATIO, "growth_max": 1.0}
    return result


LABELS = {
    "reform_s": "group re-formation, world {w}",
    "reform_rank0_late_s": "group re-formation, rank 0 {late} s late, world {w}",
}


def rows(res: dict[str, Any]) -> list[Any]:
    """The summary table's rows (:func:`bench.table_rows.summary_rows`)."""
    from bench.table_rows import Row, seconds

    target, late = res["target"], res["setup"]["rank0_late_s"]
    out = []
    for metric, label in LABELS.items():
        ours, theirs = res["trainguard"][metric], res["baseline_rank0_store"][metric]
        for world, ratio in res["ratio"][metric].items():
            a, b = ours[world]["median"], theirs[world]["median"]
            if a is None or b is None or ratio is None:
                continue
            if int(world) == target["ratio_at"]:
                verdict = (
                    f"target <= {target['ratio_max']}x met"
                    if ratio <= target["ratio_max"]
                    else f"**misses the <= {target['ratio_max']}x target**"
                )
            else:
                verdict = "trainguard better" if ratio < 1 else "**trainguard worse**"
            what = label.format(w=world, late=f"{late:g}")
            out.append(
                Row("group_start", what, seconds(a), "TCPStore on rank 0", seconds(b),
                    f"{ratio:.2f}x", verdict)
            )  # fmt: skip
        growth = res["growth_exponent"][metric]["trainguard"]
        base = res["growth_exponent"][metric]["baseline_rank0_store"]
        if growth is not None:
            worlds = res["setup"]["worlds"]
            theirs_growth = "—" if base is None else f"N^{base:.2f}"
            out.append(
                Row("group_start", f"{label.format(w='N', late=f'{late:g}')}: growth "
                    f"{worlds[0]} -> {worlds[-1]}", f"N^{growth:.2f}", "TCPStore on rank 0",
                    theirs_growth, "—", "no worse than linear (the target)" if growth <= 1.0
                    else "**worse than linear (the target: at most N^1)**")
            )  # fmt: skip
    return out


def rank_main(rank: int, world: int, stdin: IO[str], stdout: IO[str]) -> int:
    """One light rank: form a group per line read, answer with the time it was formed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    print("ready", file=stdout, flush=True)
    for line in stdin:
        order = json.loads(line)
        os.environ["MASTER_ADDR"] = order["addr"]
        os.environ["MASTER_PORT"] = str(order["port"])
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(bool(order["agent_store"]))
        time.sleep(float(order["delay"]))
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
        value = torch.ones(1)
        dist.all_reduce(value)
        formed = time.time()
        assert int(value.item()) == world, value
        dist.destroy_process_group()
        print(json.dumps({"t": formed}), file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rank":
        sys.exit(rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.stdin, sys.stdout))
    worlds = tuple(int(w) for w in sys.argv[1:]) or WORLDS
    print(json.dumps(measure(worlds, QUICK_ROUNDS, Path("/var/tmp/tg-group-start")), indent=1))
