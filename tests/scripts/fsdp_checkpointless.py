"""An FSDP2/HSDP torchrun script (fsdp_plain.py) and the same, checkpointless."""

import argparse
import time

import torch
import torch.distributed as dist

import trainguard.resilient as resilient
from trainguard.resilient import fully_shard, init_device_mesh

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--hsdp", action="store_true", help="2 replicas of the shards")
parser.add_argument("--save-final", default="")
args = parser.parse_args()

resilient.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
if args.hsdp:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
else:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * world_size + rank)
    x = torch.randn(8, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(step: int) -> None:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)  # the mean over the ranks, as torchtitan logs it
    if rank == 0:
        print(f"step {step} loss {logged.item() / world_size:.10f}", flush=True)
    time.sleep(args.step_sleep)


resilient.loop(train_step, range(1, args.steps + 1), {"model": model, "optim": optimizer})
final = {name: param.full_tensor() for name, param in model.named_parameters()}
if rank == 0 and args.save_final:
    torch.save(final, args.save_final)
dist.barrier()
dist.destroy_process_group()
