"""The data cache (`trainguard.data.DataCache`) against a plain DataLoader, same run.

``python -m bench --only data_cache`` (``make bench`` runs it too). The source is a
map-style dataset whose every sample takes ``SAMPLE_S`` (20 ms, slept: a slow disk or a
tokenizer), global batch ``BATCH`` on one rank; both sides read with ``WORKERS`` (the
cache: threads of the node's reader; the DataLoader: worker processes).

- ``restart_first_batch_s``: a rank restarted at step ``POSITION``: from the restarted
  process's first line after its imports (the loader made there) to its first batch.
  trainguard: a first process ran steps 0..POSITION-1 through the cache and was SIGKILLed
  (its reader had prefetched ahead); the restarted one finds batch POSITION in the cache.
  Baseline: a plain DataLoader that skips ahead to its position the cheapest way, a
  sampler that starts at sample ``POSITION * BATCH`` (no batch before it is read). Target
  <= 0.1x.
- ``steps_per_s``: a training loop of ``STEPS`` steps (after ``WARMUP``) whose step
  computes for about ``STEP_S`` (matrix products, one thread): the cache's reader thread
  shares the rank's process, the DataLoader's workers are processes of their own. Target
  >= 0.98x. ``data_bound_steps_per_s``: the same with no compute (the loaders' own pace),
  reported, no target.

The sides alternate within each repetition (a slow spell of the shared machine hits both).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.02
BATCH = 16
WORKERS = 4
POSITION = 20
STEPS, WARMUP = 40, 5
STEP_S = 0.1
REPEATS, QUICK_REPEATS = 5, 2
RESTART_TARGET, THROUGHPUT_TARGET = 0.1, 0.98
SIDES = ("trainguard", "baseline_dataloader")


def _dataset() -> Any:
    import torch

    class Slow(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            time.sleep(SAMPLE_S)
            return {"x": torch.full((256,), float(i)), "y": torch.tensor(i)}

    return Slow()


def _loader(side: str, directory: str, start: int) -> Callable[[int], Any]:
    """``next_batch(step)`` for one side, its loader made now."""
    import torch

    if side == "trainguard":
        from trainguard.data import DataCache

        cache = DataCache(_dataset(), BATCH, workers=WORKERS, directory=directory, ahead=8)
        return cache.batch
    sampler = range(start * BATCH, 1_000_000)
    loader = torch.utils.data.DataLoader(
        _dataset(), batch_size=BATCH, sampler=sampler, num_workers=WORKERS
    )
    iterator = iter(loader)
    return lambda step: next(iterator)


def _compute(seconds: float) -> None:
    import torch

    if seconds <= 0:
        return
    a = torch.full((256, 256), 1.0 / 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = a @ a


def worker(mode: str, side: str, directory: str) -> dict[str, Any]:
    """One process: ``fill`` (steps 0..POSITION-1, then wait to be killed), ``restart``
    (the first batch at POSITION) or ``steady``/``data_bound`` (steps per second)."""
    import torch

    import trainguard.data  # noqa: F401  (imports before the clock, as torch's)

    torch.set_num_threads(1)
    began = time.perf_counter()
    if mode == "restart":
        next_batch = _loader(side, directory, POSITION)
        batch = next_batch(POSITION)
        assert batch["y"][0].item() == POSITION * BATCH, batch["y"]
        return {"first_batch_s": time.perf_counter() - began}
    if mode == "fill":
        next_batch = _loader(side, directory, 0)
        for step in range(POSITION):
            next_batch(step)
        print(json.dumps({"filled": True}), flush=True)
        time.sleep(600)
        return {}
    next_batch = _loader(side, directory, 0)
    step_s = STEP_S if mode == "steady" else 0.0
    for step in range(WARMUP):
        next_batch(step)
        _compute(step_s)
    t0 = time.perf_counter()
    for step in range(WARMUP, WARMUP + STEPS):
        batch = next_batch(step)
        assert batch["y"][0].item() == step * BATCH
        _compute(step_s)
    return {"steps_per_s": STEPS / (time.perf_counter() - t0)}


def _run(mode: str, side: str, directory: Path, timeout: float = 300.0) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.data_cache", mode, side, str(directory)]
    done = subprocess.run(
        argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"bench.data_cache {mode} {side} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRAINGUARD_CHECKPOINT_MEMORY_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _restart(side: str, directory: Path) -> float:
    """A restart's first batch (trainguard: after a first process filled the cache)."""
    shutil.rmtree(directory, ignore_errors=True)
    if side == "trainguard":
        argv = [sys.executable, "-m", "bench.data_cache", "fill", side, str(directory)]
        fill = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
        try:
            assert fill.stdout is not None and "filled" in fill.stdout.readline()
            time.sleep(1.0)  # its reader prefetches ahead meanwhile, as in a run
        finally:
            fill.send_signal(signal.SIGKILL)
            fill.wait()
    try:
        return float(_run("restart", side, directory)["first_batch_s"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def measure(repeats: int, workdir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    from bench.report import load_average, summary

    directory = Path("/dev/shm") / f"tg-bench-data-{os.getpid()}"
    runs: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    load_before = load_average()
    for rep in range(repeats):
        for side in SIDES:
            figures = {
                "restart_first_batch_s": _restart(side, directory),
                "steps_per_s": _steady("steady", side, directory),
                "data_bound_steps_per_s": _steady("data_bound", side, directory),
            }
            for metric, value in figures.items():
                runs[side].setdefault(metric, []).append(value)
            log(f"data_cache {rep + 1}/{repeats} {side}: " + ", ".join(
                f"{m} {v:.3f}" for m, v in figures.items()))  # fmt: skip
    result: dict[str, Any] = {
        "setup": {
            "sample_s": SAMPLE_S,
            "global_batch": BATCH,
            "workers": WORKERS,
            "restart_position": POSITION,
            "steps": STEPS,
            "step_compute_s": STEP_S,
            "repeats": repeats,
            "load_before": load_before,
            "load_after": load_average(),
        },
        "target": {"restart_first_batch_s": RESTART_TARGET, "steps_per_s": THROUGHPUT_TARGET},
    }
    for side in SIDES:
        result[side] = {m: {**summary(v), "values": v} for m, v in runs[side].items()}
    result["ratio"] = {
        m: _ratio(result["trainguard"][m]["median"], result["baseline_dataloader"][m]["median"])
        for m in runs["trainguard"]
    }
    return result


def _steady(mode: str, side: str, directory: Path) -> float:
    shutil.rmtree(directory, ignore_errors=True)
    try:
        return float(_run(mode, side, directory)["steps_per_s"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


LABELS = {
    "restart_first_batch_s": ("restart -> first batch (20 ms/sample)", True),
    "steps_per_s": ("steady steps/s (0.1 s compute/step)", False),
    "data_bound_steps_per_s": ("data-bound steps/s (no compute)", False),
}


def rows(res: dict[str, Any]) -> list[Any]:
    """The summary table's rows (:func:`bench.table_rows.summary_rows`)."""
    from bench.table_rows import Row, count, seconds, verdict

    out = []
    for metric, (label, lower_is_better) in LABELS.items():
        ours = res["trainguard"][metric]["median"]
        theirs = res["baseline_dataloader"][metric]["median"]
        ratio = res["ratio"][metric]
        if ours is None or theirs is None or ratio is None:
            continue
        target = res["target"].get(metric)
        if target is None:
            judged = verdict(ratio, lower_is_better)
        elif (ratio <= target) if lower_is_better else (ratio >= target):
            judged = f"target {'<=' if lower_is_better else '>='} {target}x met"
        else:
            judged = f"**misses the {'<=' if lower_is_better else '>='} {target}x target**"
        fmt = seconds if lower_is_better else (lambda v: f"{count(round(v, 2))}/s")
        baseline = "DataLoader skipping ahead" if lower_is_better else "DataLoader"
        out.append(
            Row("data_cache", label, fmt(ours), baseline, fmt(theirs), f"{ratio:.2f}x", judged)
        )
    return out


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], sys.argv[2], sys.argv[3])), flush=True)
