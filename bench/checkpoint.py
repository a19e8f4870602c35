"""Checkpoint save cost: trainguard's memory tier against torch.save and DCP async_save.

    python -m bench.checkpoint --sizes 256,1024 --repeats 3 --out bench/out/checkpoint.json

For each size (MiB of float32 state in 4 tensors), in one process and one run:

- ``trainguard_save_s``: blocking time of ``Checkpointer.save`` (slots pre-faulted by
  ``load_latest``, as in a training script), waiting for the background checksum between
  repetitions so every repetition starts idle;
  interleaved with the memcpy below;
- ``baseline_torch_save_s``: ``torch.save`` to a file on local disk (not /dev/shm),
  plain (no fsync; the data may still be in the page cache when it returns);
- ``baseline_dcp_async_save_s``: blocking time of ``torch.distributed.checkpoint.async_save``
  (gloo group of one, to a local directory), then waiting for its future;
- ``baseline_memcpy_s``: ``dst.copy_(src)`` into pre-allocated, pre-faulted tensors, and
  the copy bandwidth of ``save()`` against it.

Times are median, min and max over the repetitions; ``ratio_*`` are trainguard over the
baseline (medians). ``python -m bench`` runs this as its ``checkpoint`` scenario.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TENSORS = 4


def _stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def _timed(
    fn: Callable[[], Any], repeats: int, after: Callable[[], Any] | None = None
) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return times


def _state(mib: int) -> dict[str, Any]:
    numel = (mib << 20) // 4 // TENSORS
    return {f"layer{i}": torch.randn(numel) for i in range(TENSORS)} | {"step": 0}


def _init_gloo() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def bench_size(mib: int, repeats: int, disk_dir: Path, shm_dir: Path) -> dict[str, Any]:
    from trainguard.checkpoint import Checkpointer

    state = _state(mib)
    nbytes = sum(
        t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
    )
    result: dict[str, Any] = {"bytes": nbytes}

    # trainguard (memory tier only; load_latest pre-faults the slots, as in training) and a
    # plain memcpy into pre-faulted tensors, interleaved so both see the same machine.
    ckpt = Checkpointer(memory_dir=str(shm_dir / f"{mib}"), job_id="bench", environ={})
    ckpt.load_latest(state)
    dst = {k: torch.empty_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    for t in dst.values():
        t.zero_()

    def memcpy() -> None:
        for k, t in dst.items():
            t.copy_(state[k])

    tg: list[float] = []
    mc: list[float] = []
    for step in range(1, repeats + 1):
        tg += _timed(functools.partial(ckpt.save, step, state), 1, after=ckpt.wait)
        mc += _timed(memcpy, 1)
    ckpt.close()
    dst.clear()
    shutil.rmtree(shm_dir / f"{mib}", ignore_errors=True)
    result["trainguard_save_s"] = _stats(tg)
    result["baseline_memcpy_s"] = _stats(mc)

    path = disk_dir / f"state-{mib}.pt"
    result["baseline_torch_save_s"] = _stats(
        _timed(lambda: torch.save(state, path), repeats, after=lambda: path.unlink())
    )

    import torch.distributed.checkpoint as dcp

    _init_gloo()
    futures: list[Any] = []
    counter = iter(range(1 << 30))
    dcp_times = _timed(
        lambda: futures.append(
            dcp.async_save(state, checkpoint_id=str(disk_dir / f"dcp-{mib}-{next(counter)}"))
        ),
        repeats,
        after=lambda: futures[-1].result(),
    )
    result["baseline_dcp_async_save_s"] = _stats(dcp_times)

    tg_med = result["trainguard_save_s"]["median"]
    result["trainguard_bandwidth_gbps"] = nbytes / tg_med / 1e9
    result["baseline_memcpy_bandwidth_gbps"] = nbytes / result["baseline_memcpy_s"]["median"] / 1e9
    result["ratio_save_vs_torch_save"] = tg_med / result["baseline_torch_save_s"]["median"]
    result["ratio_save_vs_dcp_async_save"] = tg_med / result["baseline_dcp_async_save_s"]["median"]
    result["ratio_bandwidth_vs_memcpy"] = (
        result["trainguard_bandwidth_gbps"] / result["baseline_memcpy_bandwidth_gbps"]
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="MiB of state, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    results: dict[str, dict[str, Any]] = {}
    disk_dir = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    shm_dir = Path(tempfile.mkdtemp(prefix="tg-bench-", dir="/dev/shm"))
    try:
        for mib in sizes:
            results[f"{mib}MiB"] = bench_size(mib, args.repeats, disk_dir, shm_dir)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
