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

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import checkpoint_parser, init_gloo_alone, save_restore, state_of


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
    p = checkpoint_parser(__doc__)
    p.add_argument("--membrain-port", type=int, required=True)
    args = p.parse_args()
    point_client_at(args.membrain_port)
    from amzn_sagemaker_checkpointing.checkpointing.filesystem import (
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )
    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import (
        SageMakerCheckpointConfig,
    )

    init_gloo_alone()
    config = SageMakerCheckpointConfig(namespace=f"bench-{os.getpid()}", world_size=1)
    state = state_of(args.mib)

    def save(step: int) -> object:
        writer = SageMakerTieredStorageWriter(checkpoint_config=config, step=step)
        return dcp.async_save(state_dict=state, storage_writer=writer).result

    def restore(step: int) -> None:
        reader = SageMakerTieredStorageReader(checkpoint_config=config, step=step)
        dcp.load(state, storage_reader=reader)

    figures = save_restore(state, args.repeats, save, restore)  # type: ignore[arg-type]
    dist.destroy_process_group()
    args.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
