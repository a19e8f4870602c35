"""DLRover's flash checkpoint (``DdpCheckpointer``, memory storage): save blocking, restore.

    python dlrover_ckpt.py --mib 64 --repeats 3 --dir DIR --out FILE.json

Run in the peers' environment by :mod:`bench.peers.checkpoints`, without ``dlrover-run``:
the checkpointer then starts its own saver process (DLRover's fallback, which lives only
as long as the training process). One gloo rank. ``save_s``: ``save_checkpoint(step,
state, storage_type=StorageType.MEMORY)`` until it returns (a copy into its shared
memory); ``restore_s``: ``load_checkpoint()`` from that shared memory in the same process
(no restarted process: the saver would die with this one), and whether it came back equal.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import state_of


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    state = state_of(args.mib)
    ckpt = DdpCheckpointer(str(args.dir))
    saves, restores, identical = [], [], True
    for step in range(1, args.repeats + 1):
        for t in state.values():
            t.add_(1.0)
        saved = {k: t.clone() for k, t in state.items()}
        start = time.perf_counter()
        ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = ckpt.load_checkpoint()
        restores.append(time.perf_counter() - start)
        got = loaded.get("model_states", loaded) if isinstance(loaded, dict) else {}
        identical = identical and all(k in got and torch.equal(got[k], saved[k]) for k in saved)
    args.out.write_text(
        json.dumps({"save_s": saves, "restore_s": restores, "identical": identical})
    )
    os._exit(0)  # its saver process and queues do not shut down on their own


if __name__ == "__main__":
    main()
