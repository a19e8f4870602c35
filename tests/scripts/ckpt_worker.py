"""A DDP script that adopts trainguard.checkpoint in the documented few lines.

It prints a digest of its whole state at every save and after a restore, so a
test can check that what was restored is bit-identical to what was saved.
"""

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.checkpoint import Checkpointer

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--step-sleep", type=float, default=0.05)
parser.add_argument(
    "--die-after-save",
    default="",
    help="RANK@STEP: SIGKILL itself right after save() returns, on the first attempt",
)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for key, value in sorted(state["model"].items()):
        h.update(key.encode() + value.detach().cpu().numpy().tobytes())
    for pid, pstate in sorted(state["optim"]["state"].items()):
        for key, value in sorted(pstate.items()):
            data = value.numpy().tobytes() if torch.is_tensor(value) else repr(value).encode()
            h.update(f"{pid}{key}".encode() + data)
    h.update(repr(state["step"]).encode() + state["rng"].numpy().tobytes())
    return h.hexdigest()[:16]


state = {
    "model": model.state_dict(),
    "optim": optim.state_dict(),
    "step": 0,
    "rng": torch.get_rng_state(),
}
ckpt = Checkpointer()
restored = ckpt.load_latest(state)
if restored is not None:
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
    print(
        f"rank {rank} attempt {attempt} restored step {restored} digest {digest(state)}", flush=True
    )
start = (restored or 0) + 1
die_rank, _, die_step = args.die_after_save.partition("@")
for step in range(start, args.steps + 1):
    x = torch.randn(16, 32)
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    state = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
    }
    ckpt.save(step, state)
    print(f"rank {rank} attempt {attempt} saved step {step} digest {digest(state)}", flush=True)
    if rank == 0:
        print(f"Batch {step} Loss: {loss.item():.5f}", flush=True)
    if args.die_after_save and attempt == 0 and (rank, step) == (int(die_rank), int(die_step)):
        os.kill(os.getpid(), signal.SIGKILL)  # no wait(): the snapshot must already be safe
    time.sleep(args.step_sleep)
ckpt.wait()
ckpt.close()
dist.barrier()  # all ranks done before any tears the group down (gloo aborts otherwise)
dist.destroy_process_group()
