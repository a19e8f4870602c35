"""SageMaker's tiered checkpointing: DCP save blocking and restore, against its stand-in.

    python sagemaker_ckpt.py --membrain-port P --mib 64 --repeats 3 --out FILE.json

Run in the peers' environment by :mod:`bench.peers.checkpoints`, with the library's own
in-memory service stand-in (``membrain_server.py`` from its sdist, a FastAPI app) already
serving on ``--membrain-port``. The client is pointed at it the way the library's own
integration tests do (``InMemoryClientConfig(base_url=...)`` patched into
``InMemoryCheckpointClient``). One gloo rank; the memory tier only (no disk, no S3).
``save_s``: ``torch.distributed.checkpoint.async_save`` with
``SageMakerTieredStorageWriter`` until it returns (the training loop's block); then its
future is awaited (untimed). ``restore_s``: ``dcp.load`` with
``SageMakerTieredStorageReader`` into the zeroed state, and whether it came back equal.
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
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import state_of


def point_client_at(port: int) -> None:
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig
    from amzn_sagemaker_checkpointing.storage.clients.inmemory import inmemory_client

    original = inmemory_client.InMemoryCheckpointClient.__init__

    def patched(self: object, *args: object, config: object = None, **kwargs: object) -> None:
        config = config or InMemoryClientConfig(
            base_url=f"http://127.0.0.1:{port}", log_requests=False
        )
        original(self, *args, config=config, **kwargs)  # type: ignore[misc]

    inmemory_client.InMemoryCheckpointClient.__init__ = patched  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--membrain-port", type=int, required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    point_client_at(args.membrain_port)
    from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
        SageMakerCheckpointConfig,
    )

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = SageMakerCheckpointConfig(namespace=f"bench-{os.getpid()}", world_size=1)
    state = state_of(args.mib)
    saves, restores, identical = [], [], True
    for step in range(1, args.repeats + 1):
        for t in state.values():
            t.add_(1.0)
        saved = {k: t.clone() for k, t in state.items()}
        writer = SageMakerTieredStorageWriter(checkpoint_config=config, step=step)
        start = time.perf_counter()
        future = dcp.async_save(state_dict=state, storage_writer=writer)
        saves.append(time.perf_counter() - start)
        future.result()
        for t in state.values():
            t.zero_()
        reader = SageMakerTieredStorageReader(checkpoint_config=config, step=step)
        start = time.perf_counter()
        dcp.load(state, storage_reader=reader)
        restores.append(time.perf_counter() - start)
        identical = identical and all(torch.equal(state[k], saved[k]) for k in state)
    dist.destroy_process_group()
    args.out.write_text(
        json.dumps({"save_s": saves, "restore_s": restores, "identical": identical})
    )


if __name__ == "__main__":
    main()
