"""A DCP step of a sharded tensor, saved or loaded by one rank per node (test_agent_replicas.py).

    DCP_MODE=save|load DCP_STORE=<file store> dcp_replica.py

The ranks (``RANK``/``WORLD_SIZE`` from the node agent) meet through a file store. Each
holds its shard of a DTensor (``Shard(0)`` on a 1-D mesh) and writes it with
``TieredStorageWriter`` into its node's memory tier (``TRAINGUARD_CHECKPOINT_MEMORY_DIR``),
no durable tier. ``load`` reads it back into a zeroed DTensor with ``TieredStorageReader``
and writes ``out/rank-<R>.json`` beside the store: whether the values came back, and where each
file was read from (``sources``).
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainguard.checkpoint.dcp import TieredStorageReader, TieredStorageWriter

STEP = 4
mode, store = os.environ["DCP_MODE"], os.environ["DCP_STORE"]
out = Path(store).parent / "out"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
whole = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
if mode == "save":
    state = {"w": distribute_tensor(whole, mesh, [Shard(0)])}
    dcp.save(state, storage_writer=TieredStorageWriter(step=STEP))
else:
    state = {"w": distribute_tensor(torch.zeros_like(whole), mesh, [Shard(0)])}
    reader = TieredStorageReader(step=STEP)
    dcp.load(state, storage_reader=reader)
    equal = bool(torch.equal(state["w"].full_tensor(), whole))
    result = {"equal": equal, "sources": reader.sources}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
dist.barrier()
dist.destroy_process_group()
