"""A torchrun script with trainguard.elastic's few lines (gloo, no model).

    elastic_train.py OUT EPOCH_LEN

Each optimizer step takes a global batch of 12 samples, split over the world
(``batch_split``); the data position is repartitioned at every world size
(``shard_indices``). When ``scale_requested()`` says so (every rank at the same step),
rank 0 saves the samples consumed, and every rank exits 0: the job restarts at the new
size and resumes there. Each rank appends the indices it took to OUT/samples-rank-R.txt.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.elastic import batch_split, scale_requested, shard_indices

GLOBAL_BATCH = 12

out, epoch_len = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
saved = out / "checkpoint.json"
state = json.loads(saved.read_text()) if saved.exists() else {"consumed": 0, "step": 0}
split = batch_split(GLOBAL_BATCH, world)
shard = shard_indices(epoch_len, state["consumed"], rank, world, split.per_rank)
print(
    f"world {world}: global batch {split.global_batch} = {split.per_rank} per rank x "
    f"{split.accumulation_steps} steps x {world} ranks",
    flush=True,
)
step, micro = state["step"], 0
for indices in shard:
    with open(out / f"samples-rank-{rank}.txt", "a") as samples:
        samples.write(" ".join(map(str, indices)) + "\n")
    micro += 1
    if micro % split.accumulation_steps:
        continue
    dist.all_reduce(torch.ones(1))  # the step's collective
    step += 1
    print(f"Step {step}", flush=True)
    time.sleep(0.05)
    if scale_requested():
        if rank == 0:
            saved.write_text(json.dumps({"consumed": shard.consumed_after(micro), "step": step}))
        dist.barrier()
        print(f"scale requested at step {step}: saved, exiting", flush=True)
        sys.exit(0)
dist.destroy_process_group()
