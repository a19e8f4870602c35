"""The training script of the ``state_scale`` scenario: DDP + Adam over a state of a given size.

``python bench/state_scale_train.py --out DIR --state-gb G --steps N`` runs ``N`` steps of
a stack of square ``Linear`` layers whose Adam state (weights and two moments: 12 bytes a
parameter) is ``G`` GB a rank, on gloo, with a batch that is a function of (step, rank).

- ``--mode resilient``: ``resilient.loop`` (checkpointless under trainguard's in-process
  restarts; the model built inside ``resilient.no_init_on_spare()``);
- ``--mode relaunch``: a plain torchrun script that ``torch.save``s its state to
  ``--snapshot-dir`` (``/dev/shm``) every ``--snapshot-every`` steps and resumes from the
  newest snapshot when started again;
- ``--mode process``: under ``trainguard run`` with the memory tier: a
  ``trainguard.checkpoint.Checkpointer`` (configured by the job) saved each step (it
  snapshots every ``memoryEverySteps``) and ``load_latest`` at start. Each rank writes
  ``DIR/start-<rank>-<pid>.json``: the Unix times at which its process started and each
  phase of its start ended (``imports``, ``group``, ``model``, ``load``, ``ddp``), and
  what it restored.

Rank 0 appends ``{"step", "time", "pid"}`` to ``DIR/steps.jsonl`` after each completed step
(and prints ``Step N``, the progress line trainguard's step injections read).
"""

from __future__ import annotations

import time

BEGAN = time.time()  # before the imports: the script's own start

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trainguard.resilient as resilient  # noqa: E402
from trainguard.checkpoint import Checkpointer  # noqa: E402

WIDTH = 1024  # a layer: 1M parameters, 12 MB of Adam state

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--state-gb", type=float, required=True)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--mode", choices=["resilient", "relaunch", "process"], default="resilient")
parser.add_argument("--snapshot-dir", type=Path, default=Path("/dev/shm"))
parser.add_argument("--snapshot-every", type=int, default=5)
args = parser.parse_args()
layers = max(1, round(args.state_gb * 1e9 / (12 * (WIDTH * WIDTH + WIDTH))))
phases: dict[str, float] = {"imports": time.time()}


def process_started() -> float:
    """This process's start (Unix time), from /proc."""
    with open("/proc/self/stat", encoding="ascii") as f:
        ticks = int(f.read().rpartition(")")[2].split()[19])
    with open("/proc/stat", encoding="ascii") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


if args.mode == "resilient":
    resilient.init_process_group("gloo")
else:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
phases["group"] = time.time()
torch.manual_seed(0)
with resilient.no_init_on_spare():
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
phases["model"] = time.time()
checkpointer = Checkpointer() if args.mode == "process" else None
restored = None
if checkpointer is not None:
    restored = checkpointer.load_latest({"model": model, "optim": optimizer})
    phases["load"] = time.time()
ddp = (
    resilient.DistributedDataParallel(model)  # made in the loop, without a broadcast after a sync
    if args.mode == "resilient"
    else torch.nn.parallel.DistributedDataParallel(model)
)
phases["ddp"] = time.time()
if checkpointer is not None:
    last = checkpointer.last_restore
    start_record = {
        "rank": rank,
        "pid": os.getpid(),
        "process_started": process_started(),
        "script_started": BEGAN,
        "phases": phases,
        "restored_step": restored,
        "restore_s": last.seconds if last else None,
        "restore_tier": last.tier if last else None,
        "restore_phases": last.phases if last else None,
    }
    path = args.out / f"start-{rank}-{os.getpid()}.json"
    path.write_text(json.dumps(start_record), encoding="utf-8")


def record(step: int) -> None:
    if rank == 0:
        line = json.dumps({"step": step, "time": time.time(), "pid": os.getpid()})
        with open(args.out / "steps.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        print(f"Step {step}", flush=True)


def train_step(step: int) -> None:
    gen = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(4, WIDTH, generator=gen)
    loss = ddp(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    record(step)


steps = range(1, args.steps + 1)
if args.mode == "resilient":
    resilient.loop(train_step, steps, {"model": model, "optim": optimizer}, checkpoints=False)
elif checkpointer is not None:
    for step in range((restored or 0) + 1, args.steps + 1):
        train_step(step)
        checkpointer.save(step, {"model": model, "optim": optimizer})
    checkpointer.close()
else:
    snapshot = args.snapshot_dir / f"tg-state-scale-{rank}.pt"
    start = 1
    if snapshot.exists():
        saved = torch.load(snapshot, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        start = int(saved["step"]) + 1
    for step in range(start, args.steps + 1):
        train_step(step)
        if step % args.snapshot_every == 0:
            state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
            torch.save(state, snapshot.with_suffix(".tmp"))
            os.replace(snapshot.with_suffix(".tmp"), snapshot)
dist.barrier()
dist.destroy_process_group()
