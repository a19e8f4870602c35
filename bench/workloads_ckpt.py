"""Checkpoint save and restore of one workload's real training state (``workloads`` scenario).

    python -m bench.workloads_ckpt --workload gpt --repeats 3 --out bench/out/ckpt-gpt.json
    python -m bench.workloads_ckpt --workload mlp --hidden 5120 --repeats 3 --out ...

The state is what the benchmarks' training script snapshots every step: ``{"model":
model.state_dict(), "optim": optimizer.state_dict(), "step": n}``, after one training
step (so the optimizer's state exists), in one process. Its tensors are the model's and
the optimizer's, as they are (not :mod:`bench.checkpoint`'s 4 equal tensors). Repetitions
interleave every figure:

- ``trainguard_save_s``: blocking time of ``Checkpointer.save`` (memory tier, slots
  pre-faulted by ``load_latest`` as in the training script; a durable tier on local disk,
  written in the background), then ``wait()``, untimed, so each save starts idle;
- ``baseline_memcpy_s``: a plain copy of the same tensors into pre-faulted ones;
- ``baseline_torch_save_s``: ``torch.save`` of the state to local disk (what the torchrun
  baseline's rank 0 does every ``--ckpt-every`` steps);
- ``trainguard_restore_memory_s`` / ``trainguard_restore_durable_s``: ``load_latest``
  of a new Checkpointer (as a restarted worker's) from the memory tier, and from the
  durable tier alone (its memory directory empty), into a zeroed state;
- ``baseline_torch_load_s``: ``torch.load`` of that file and ``load_state_dict`` of both.

Times are median, min and max; ``ratio_*`` are medians over medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

WORKLOADS = ("gpt", "mlp")


def model_and_optimizer(
    workload: str, hidden: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The workload's model and optimizer after one step (``bench/train.py``'s or
    ``bench/workloads_gpt.py``'s build and loss, without a process group)."""
    from bench import train, workloads_gpt

    build = workloads_gpt.build if workload == "gpt" else train.build
    recorder_type = workloads_gpt.GPTRecorder if workload == "gpt" else train.Recorder
    net, optim, _, _ = build(["--hidden", str(hidden), "--out", os.devnull, "--device", "cpu"])
    out = Path(tempfile.mkdtemp(prefix="tg-wl-"))  # the recorder's pid file
    recorder = recorder_type(out, 0, 1, "ckpt")
    try:
        loss = recorder.loss(1, net)
        optim.zero_grad()
        loss.backward()
        optim.step()
    finally:
        recorder.close()
        shutil.rmtree(out, ignore_errors=True)
    return net, optim


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested state, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in obj:
            yield from tensors(obj[key])
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from tensors(item)


def _stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(workload: str, hidden: int, repeats: int, disk: Path, shm: Path) -> dict[str, Any]:
    from trainguard.checkpoint import Checkpointer

    net, optim = model_and_optimizer(workload, hidden)

    def state(step: int) -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": optim.state_dict(), "step": step}

    live = list(tensors(state(0)))
    copies = [torch.zeros_like(t) for t in live]  # pre-faulted: every page written
    nbytes = sum(t.numel() * t.element_size() for t in live)
    params = sum(p.numel() for p in net.parameters())
    memory_dir, durable = shm / "memory", disk / "durable"
    ckpt_file = disk / "checkpoint.pt"

    def checkpointer(memory: Path) -> Any:
        return Checkpointer(
            memory_dir=str(memory),
            durable_url=str(durable),
            durable_every_steps=1,
            job_id=f"bench-{workload}",
            rank=0,
            world_size=1,
            environ={},
        )

    def memcpy() -> None:
        for dst, src in zip(copies, live, strict=True):
            dst.copy_(src)

    def torch_load() -> None:
        saved = torch.load(ckpt_file, map_location="cpu", weights_only=True)
        net.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])

    def restore(memory: Path) -> tuple[float, str | None]:
        for t in live:
            t.zero_()
        loader = checkpointer(memory)
        try:
            seconds = _timed(lambda: loader.load_latest(state(0)))
            tier = loader.last_restore.tier if loader.last_restore else None
        finally:
            loader.close()
        return seconds, tier

    figures: dict[str, list[float]] = {
        k: []
        for k in (
            "trainguard_save_s",
            "baseline_memcpy_s",
            "baseline_torch_save_s",
            "trainguard_restore_memory_s",
            "trainguard_restore_durable_s",
            "baseline_torch_load_s",
        )
    }
    tiers: dict[str, set[str | None]] = {"memory": set(), "durable": set()}
    saver = checkpointer(memory_dir)
    saver.load_latest(state(0))  # nothing to restore: pre-faults the slots
    try:
        for step in range(1, repeats + 1):
            figures["trainguard_save_s"].append(_timed(lambda: saver.save(step, state(step))))  # noqa: B023
            saver.wait()
            figures["baseline_memcpy_s"].append(_timed(memcpy))
            figures["baseline_torch_save_s"].append(
                _timed(lambda: torch.save(state(step), ckpt_file))  # noqa: B023
            )
            seconds, tier = restore(memory_dir)
            figures["trainguard_restore_memory_s"].append(seconds)
            tiers["memory"].add(tier)
            seconds, tier = restore(shm / f"empty-{step}")
            figures["trainguard_restore_durable_s"].append(seconds)
            tiers["durable"].add(tier)
            figures["baseline_torch_load_s"].append(_timed(torch_load))
    finally:
        saver.close()
    result: dict[str, Any] = {
        "workload": workload,
        "state_bytes": nbytes,
        "state_tensors": len(live),
        "params": params,
        "repeats": repeats,
        "restore_tiers": {k: sorted(str(t) for t in v) for k, v in tiers.items()},
    }
    result |= {k: _stats(v) for k, v in figures.items()}
    med = {k: v["median"] for k, v in result.items() if isinstance(v, dict) and "median" in v}
    result["ratio_save_vs_memcpy"] = med["trainguard_save_s"] / med["baseline_memcpy_s"]
    result["ratio_save_vs_torch_save"] = med["trainguard_save_s"] / med["baseline_torch_save_s"]
    result["ratio_restore_memory_vs_durable"] = (
        med["trainguard_restore_memory_s"] / med["trainguard_restore_durable_s"]
    )
    result["ratio_restore_memory_vs_torch_load"] = (
        med["trainguard_restore_memory_s"] / med["baseline_torch_load_s"]
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's width (mlp only)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=None, help="the results' JSON (default: stdout)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    torch.set_num_threads(1)  # like each rank of the 2 x 2 job
    disk = Path(tempfile.mkdtemp(prefix="tg-wl-ckpt-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    shm = Path(tempfile.mkdtemp(prefix="tg-wl-ckpt-", dir="/dev/shm"))
    try:
        result = measure(args.workload, args.hidden, args.repeats, disk, shm)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    text = json.dumps(result, indent=2) + "\n"
    if args.out is None:
        print(text, end="")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
