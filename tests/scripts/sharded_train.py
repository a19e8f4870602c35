"""A sharded model (FSDP2, HSDP or tensor parallel) with the Checkpointer, under torchrun.

    torchrun --nproc-per-node 4 sharded_train.py --layout fsdp --steps 6 --memory-dir M

Trains a small MLP on gloo (CPU) with Adam, saving ``{"model": model, "optim":
optimizer}`` every step the way docs/checkpoints.md does, after ``load_latest``.
``--layout``: ``fsdp`` (``fully_shard`` on a 1-D mesh), ``hsdp`` (``fully_shard`` on a
2 x N/2 mesh: replicate, shard) or ``tp`` (``parallelize_module``: column-, then
row-wise). ``--plain``: no Checkpointer (the uninterrupted baseline). ``--kill-at S``:
rank 0 SIGKILLs itself right after every rank's ``save(S)`` and its checksum (torchrun
``--max-restarts`` then restarts the ranks, which resume). Rank 0 prints one JSON line:
the step it resumed from, the tier, and a digest of the full (unsharded) parameters and
Adam's moments, the same whatever the layout and world size. ``--device cuda``: each rank
on its GPU (``LOCAL_RANK``), NCCL for the model's collectives (tests/test_gpu_sharded.py).
"""

import argparse
import hashlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from trainguard.checkpoint import Checkpointer

parser = argparse.ArgumentParser()
parser.add_argument("--layout", choices=("fsdp", "hsdp", "tp"), default="fsdp")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--kill-at", type=int, default=0)
parser.add_argument("--memory-dir", default=None)
parser.add_argument("--durable-url", default=None)
parser.add_argument("--plain", action="store_true")
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()

device = torch.device(args.device)
if args.device == "cuda":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
world = dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
model.to(device)
kind = args.device
if args.layout == "fsdp":
    fully_shard(model, mesh=init_device_mesh(kind, (world,), mesh_dim_names=("shard",)))
elif args.layout == "hsdp":
    mesh = init_device_mesh(kind, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
else:
    mesh = init_device_mesh(kind, (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
state = {"model": model, "optim": optimizer}

ckpt = None
start, tier = 0, None
if not args.plain:
    ckpt = Checkpointer(
        memory_dir=args.memory_dir,
        durable_url=args.durable_url,
        job_id="sharded",
        environ={k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")},
    )
    start = ckpt.load_latest(state) or 0
    tier = ckpt.last_restore.tier if ckpt.last_restore else None

for step in range(start + 1, args.steps + 1):
    data = torch.Generator().manual_seed(step)  # the same batch on every rank and layout
    x = torch.randn(16, 8, generator=data).to(device)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :4].sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if ckpt is not None:
        ckpt.save(step, state)
        if step == args.kill_at:
            ckpt.wait()
            dist.barrier()
            if dist.get_rank() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
if ckpt is not None:
    ckpt.close()


def full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).cpu()


digest = hashlib.sha256()
for name, param in sorted(model.named_parameters()):
    digest.update(name.encode() + full(param.detach()).numpy().tobytes())
for index, moments in sorted(optimizer.state_dict()["state"].items()):
    for key, value in sorted(moments.items()):
        digest.update(f"{index}{key}".encode() + full(value).numpy().tobytes())
if dist.get_rank() == 0:
    print(json.dumps({"start": start, "tier": tier, "digest": digest.hexdigest()}), flush=True)
# Every rank done before any tears its group down (gloo in torch 2.13 may otherwise abort
# a rank at exit, "terminate called without an active exception"; see ddp_script.py).
dist.barrier()
time.sleep(0.1)
dist.destroy_process_group()
