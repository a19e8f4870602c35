"""A gloo receive of a large tensor into fresh memory, into faulted memory, and into fresh
memory faulted in ahead by :class:`trainguard.checkpoint.host_memory.Prefault`.

    python -m bench.receive_memory [--gb 1.0] [--trials 3]

Two processes on this host; rank 0 sends ``--gb`` GB in 64 MiB slices (as a peer state
transfer does) and rank 1 receives them into a tensor that is, per mode:

- ``fresh``: ``torch.empty``, never touched (a hot spare's model built without
  initialisation);
- ``faulted``: written before the receive (the link's own speed);
- ``prefault``: fresh, with the ``Prefault`` thread running ahead of the data.

Prints each mode's best GB/s over ``--trials`` (the receive's wall time on rank 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

MODES = ("fresh", "faulted", "prefault")
SLICE = 64 << 20


def _rank(nbytes: int, trials: int) -> None:
    import torch
    import torch.distributed as dist

    from trainguard.checkpoint.host_memory import Prefault

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else None
    for mode in MODES:
        best = 0.0
        for _ in range(trials):
            dist.barrier()
            if source is not None:
                works = [
                    dist.isend(source[i : i + SLICE], 1, tag=k)
                    for k, i in enumerate(range(0, nbytes, SLICE))
                ]
                for work in works:
                    work.wait()
                dist.barrier()
                continue
            target = torch.empty(nbytes, dtype=torch.uint8)
            if mode == "faulted":
                target.fill_(0)
            began = time.perf_counter()
            works = [
                dist.irecv(target[i : i + SLICE], 0, tag=k)
                for k, i in enumerate(range(0, nbytes, SLICE))
            ]
            streams = [[(target.data_ptr(), nbytes)]] if mode == "prefault" else []
            with Prefault(streams):
                for work in works:
                    work.wait()
            best = max(best, nbytes / (time.perf_counter() - began) / 1e9)
            dist.barrier()
            del target
        if rank == 1:
            print(f"{mode}: {best:.2f} GB/s", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.receive_memory")
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args(argv)
    nbytes = int(args.gb * 1e9) // SLICE * SLICE or SLICE
    if os.environ.get("RANK") is not None:
        _rank(nbytes, args.trials)
        return 0
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    argv_ = [sys.executable, "-m", "bench.receive_memory", "--gb", str(args.gb)]
    argv_ += ["--trials", str(args.trials)]
    procs = [subprocess.Popen(argv_, env={**env, "RANK": str(r)}) for r in (0, 1)]
    try:
        codes = [p.wait(600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
