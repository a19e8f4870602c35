"""Adam and the random generators through a SIGKILL and a resume (test_checkpoint_stateful.py).

One process trains a small model with dropout on batches drawn from torch's, Python's
and NumPy's global generators, saving every step the way docs/checkpoints.md does
(``{"model": model, "optim": optimizer, "rng": RNGState()}``). ``--kill-at S`` SIGKILLs
it right after ``save(S)`` (and its checksum); run again, it resumes from the newest
checkpoint. It prints one JSON line: the final loss and a digest of the model and the
optimizer's state. ``--captured`` builds the state once from state dicts instead (the
docs' old way), which a resume cannot get right.
"""

import argparse
import hashlib
import json
import os
import random
import signal

import numpy
import torch

from trainguard.checkpoint import Checkpointer, RNGState

parser = argparse.ArgumentParser()
parser.add_argument("--memory-dir", required=True)
parser.add_argument("--durable-url", default=None)
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--kill-at", type=int, default=0)
parser.add_argument("--captured", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
if args.captured:
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }
else:
    state = {"model": model, "optim": optimizer, "rng": RNGState()}
ckpt = Checkpointer(
    memory_dir=args.memory_dir,
    durable_url=args.durable_url,
    durable_every_steps=5 if args.durable_url else None,
    job_id="resume",
)
start = ckpt.load_latest(state) or 0
if args.captured and start:  # what the old docs said to do after a restore
    optimizer.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
loss = torch.zeros(())
for step in range(start + 1, args.steps + 1):
    x = torch.randn(16, 8) + random.random() + float(numpy.random.rand())
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ckpt.save(step, state)
    if step == args.kill_at:
        ckpt.wait()
        os.kill(os.getpid(), signal.SIGKILL)
ckpt.close()

digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.numpy().tobytes())
for index, moments in sorted(optimizer.state_dict()["state"].items()):
    for key, value in sorted(moments.items()):
        digest.update(f"{index}{key}".encode() + value.numpy().tobytes())
print(json.dumps({"start": start, "loss": loss.item(), "digest": digest.hexdigest()}), flush=True)
