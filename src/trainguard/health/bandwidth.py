"""``python -m trainguard.health.bandwidth``: an all-reduce bandwidth test (torch).

One process per node, run by `trainguard.health.connectivity.ConnectivityCheck`; rank 0
hosts the rendezvous (a ``TCPStore`` on ``--master-addr:--master-port``). Each process
all-reduces (sum) a float32 tensor of ``--size-mib`` MiB: once to check the sums, then
``--warmup`` more times, then ``--iterations`` timed ones. Prints one JSON object.

Bandwidth as nccl-tests reports it: ``algbw = bytes / seconds per all-reduce`` and the
bus bandwidth ``busbw = algbw * 2 * (n - 1) / n``, comparable across node counts. The
time is the slowest rank's (all ranks report the same numbers).

``--backend auto``: NCCL where CUDA is available (on device ``--device``, one GPU per
node: this measures that GPU's path between nodes), else gloo on CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final

__all__ = ["bus_bandwidth", "measure_allreduce"]

_MIB: Final = 1024 * 1024


def bus_bandwidth(size_bytes: int, seconds_per_op: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes) of one all-reduce, as nccl-tests computes them."""
    algbw = size_bytes / max(seconds_per_op, 1e-12) / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def measure_allreduce(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    size_mib: float = 64,
    backend: str = "auto",
    iterations: int = 5,
    warmup: int = 1,
    timeout: float = 60.0,
    device_index: int = 0,
) -> dict[str, Any]:
    """Join the group, time the all-reduces, leave; the numbers as a JSON-able dict."""
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", device_index) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    limit = timedelta(seconds=timeout)
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=limit)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit)
    try:
        numel = max(int(size_mib * _MIB) // 4, 1)
        tensor = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(tensor)
        correct = bool((tensor == world_size * (world_size + 1) / 2).all())
        for _ in range(warmup):
            dist.all_reduce(tensor)
        _sync(torch, device)
        dist.all_reduce(torch.zeros(1, device=device))  # start the clocks together
        _sync(torch, device)
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        _sync(torch, device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        per_op = float(elapsed.item()) / max(iterations, 1)
    finally:
        dist.destroy_process_group()
    algbw, busbw = bus_bandwidth(numel * 4, per_op, world_size)
    return {
        "rank": rank,
        "world_size": world_size,
        "backend": backend,
        "size_mib": numel * 4 / _MIB,
        "iterations": iterations,
        "seconds_per_op": per_op,
        "algbw_gbps": round(algbw, 4),
        "busbw_gbps": round(busbw, 4),
        "correct": correct,
    }


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.health.bandwidth")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        answer = measure_allreduce(
            args.rank,
            args.world_size,
            args.master_addr,
            args.master_port,
            size_mib=args.size_mib,
            backend=args.backend,
            iterations=args.iterations,
            warmup=args.warmup,
            timeout=args.timeout,
            device_index=args.device,
        )
    except Exception as exc:  # the answer says what broke
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
