"""The benchmarks' training script: a small MLP with DDP, on CUDA where it is available.

The same file runs under torchrun and under trainguard; only ``--ckpt`` differs:

- ``torch``: rank 0 ``torch.save``s model and optimizer every ``--ckpt-every`` steps into
  ``--ckpt-dir`` (tmp file + rename), and every rank resumes from it at start;
- ``trainguard``: ``trainguard.checkpoint.Checkpointer`` (configured by the job), saved
  every step (the job's ``memoryEverySteps`` picks which steps are snapshotted);
- ``resilient``: checkpointless recovery: the loop runs in ``trainguard.resilient``'s
  ``@restartable`` (a job with ``inProcessRestart``), so a crashed rank is replaced in
  place and takes its state from a peer; the memory tier (``Checkpointer``) is the
  fallback when no rank holds state;
- ``none``: no checkpoint.

``--elastic`` (an elastic job, ``bench/elastic.py``): every rank appends
``<incarnation> <rank> <world size> <pid> <time>`` to ``<out>/worlds.txt`` when an
incarnation starts, so the figures know each step's world size and whether the ranks
kept their processes; outside ``resilient`` mode every rank also asks
``trainguard.elastic.scale_requested()`` after each step and, when a scaling is
requested, rank 0 saves (``--ckpt torch``: ``torch.save`` into ``--ckpt-dir``) and every
rank returns, to be restarted at the new size (HyperPod's way). In ``resilient`` mode
the controller re-forms the group itself (or, failing that, restarts the job).
``--global-batch G`` keeps the global batch at G samples at any world size (per rank:
``trainguard.elastic.batch_split``); without it every rank takes ``BATCH``.

``--device`` (auto: CUDA where available) and ``--backend`` (auto, gloo, nccl; default
``$TRAINGUARD_BACKEND``, else auto) pick where it trains: on CUDA each rank uses
``cuda:LOCAL_RANK``, or ``cuda:LOCAL_RANK % <visible GPUs>`` with ``--backend gloo`` (ranks
sharing a GPU, which NCCL refuses); the process group is
``trainguard.collectives.backend_string``'s (gloo on the CPU). The data are made on the
CPU and moved, so a run is the same on either device up to float rounding.

It is deterministic: the data of (step, rank) comes from a generator seeded by both.
Rank 0 appends one line per completed step to ``<out>/steps.txt``::

    <incarnation> <step> <start time> <end time>

where the incarnation (``TORCHELASTIC_RUN_ID.TORCHELASTIC_RESTART_COUNT``, or the attempt
in ``resilient`` mode) tells the launches and restarts apart, and the step's time spans
its simulated compute (``--step-sleep``), forward, backward (with the all-reduce) and
optimizer step, not the checkpoint. Every rank keeps ``<out>/pids/rank<R>.json`` (pid,
incarnation) current, so the benchmark can signal a rank of the current incarnation.
"""

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.collectives import (
    BACKEND_CHOICES,
    DEVICE_CHOICES,
    backend_string,
    choose_device,
    resolve_choice,
)
from trainguard.elastic import batch_split, scale_requested

BATCH = 32
FEATURES = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="simulated compute, s")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--ckpt", choices=("torch", "trainguard", "resilient", "none"), default="none"
    )
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="log each incarnation's world size and pids; save and return on a scale request",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help=f"samples per step over all ranks (default: {BATCH} per rank)",
    )
    parser.add_argument(
        "--log-all-ranks",
        action="store_true",
        help="every rank prints a `Step N` line (rank 0 always prints its Batch line)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="auto: cuda:LOCAL_RANK where CUDA is available, else cpu",
    )
    parser.add_argument(
        "--backend",
        type=str.lower,
        choices=BACKEND_CHOICES,
        default=None,
        help="process-group backend (default: $TRAINGUARD_BACKEND, else auto)",
    )
    args = parser.parse_args(argv)
    try:
        args.backend = resolve_choice(args.backend)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def publish(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def pick_device(args: argparse.Namespace) -> torch.device:
    """This rank's device (the current CUDA device, when it is one); exits on a bad choice."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        device = choose_device(args.device, local_rank, args.backend, cuda_count)
    except ValueError as exc:
        raise SystemExit(f"train.py: error: {exc}") from None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and the final barrier use the current device
    return device


def build(
    argv: list[str] | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, argparse.Namespace, torch.device]:
    args = parse_args(argv)
    device = pick_device(args)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 1),
    ).to(device)
    return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), args, device


class Recorder:
    """Rank 0's step records and log line; every rank's pid file."""

    def __init__(
        self,
        out: Path,
        rank: int,
        world: int,
        incarnation: str,
        log_all_ranks: bool = False,
        device: torch.device | None = None,
        batch: int = BATCH,
        elastic: bool = False,
    ) -> None:
        self.rank, self.world, self.incarnation = rank, world, incarnation
        self.log_all_ranks = log_all_ranks
        self.device = device or torch.device("cpu")
        self.batch = batch
        (out / "pids").mkdir(parents=True, exist_ok=True)
        publish(out / "pids" / f"rank{rank}.json", {"pid": os.getpid(), "inc": incarnation})
        if elastic:  # one short O_APPEND write per rank: lines never interleave
            with open(out / "worlds.txt", "a", encoding="utf-8") as worlds:
                worlds.write(f"{incarnation} {rank} {world} {os.getpid()} {time.time():.6f}\n")
        path = out / "steps.txt" if rank == 0 else Path(os.devnull)
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def step(
        self,
        step: int,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        step_sleep: float,
    ) -> None:
        """One training step (its data comes from (step, rank)), recorded."""
        t0 = time.time()
        if step_sleep:
            time.sleep(step_sleep)
        loss = self.loss(step, model)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's end, not its kernels' launch
        t1 = time.time()
        self.file.write(f"{self.incarnation} {step} {t0:.6f} {t1:.6f}\n")
        self.file.flush()
        if self.rank == 0:
            speed = self.batch * self.world / max(t1 - t0, 1e-9)
            line = f"Batch {step} Loss: {loss.item():.5f}, Speed: {speed:.1f} samples/sec"
            print(line, flush=True)
        elif self.log_all_ranks:
            print(f"Step {step}", flush=True)

    def loss(self, step: int, model: torch.nn.Module) -> torch.Tensor:
        """This rank's loss at ``step``, on data made from (step, rank) (a subclass may
        train another model: ``bench/workloads_gpt.py``)."""
        gen = torch.Generator().manual_seed(step * self.world + self.rank)
        x = torch.randn(self.batch, FEATURES, generator=gen).to(self.device)
        loss: torch.Tensor = model(x).pow(2).mean()
        return loss

    def close(self) -> None:
        self.file.close()


def main(argv: list[str] | None = None) -> None:
    net, optim, args, device = build(argv)
    if args.ckpt == "resilient":
        main_resilient(net, optim, args, device)
        return
    dist.init_process_group(backend_string(args.backend, cuda=device.type == "cuda"))
    rank, world = dist.get_rank(), dist.get_world_size()
    incarnation = (
        f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}."
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    recorder = Recorder(
        args.out,
        rank,
        world,
        incarnation,
        args.log_all_ranks,
        device,
        per_rank_batch(args.global_batch, world),
        args.elastic,
    )
    model = DistributedDataParallel(net, device_ids=device_ids(device))

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step}

    start = 1
    ckpt: Any = None
    ckpt_file = (args.ckpt_dir or args.out) / "checkpoint.pt"
    if args.ckpt == "trainguard":
        from trainguard.checkpoint import Checkpointer

        ckpt = Checkpointer()
        restored_state = state(0)
        restored = ckpt.load_latest(restored_state)
        if restored is not None:
            optim.load_state_dict(restored_state["optim"])
            start = restored + 1
    elif args.ckpt == "torch" and ckpt_file.exists():
        saved = torch.load(ckpt_file, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        start = int(saved["step"]) + 1

    for step in range(start, args.steps + 1):
        recorder.step(step, model, optim, args.step_sleep)
        if args.ckpt == "trainguard":
            ckpt.save(step, state(step))
        elif args.ckpt == "torch" and step % args.ckpt_every == 0 and rank == 0:
            save_torch(state(step), ckpt_file)
        if args.elastic and scale_requested():  # every rank at the same step
            if args.ckpt == "torch" and rank == 0 and step % args.ckpt_every:
                save_torch(state(step), ckpt_file)
            break  # the job restarts at the new size and resumes from the checkpoint
    recorder.close()
    if ckpt is not None:
        ckpt.close()
    # Every rank done before any tears its group down (gloo aborts otherwise); then a
    # moment without the GIL, so the group's worker thread finishes with the barrier's
    # work before DDP's reducer drops the group (a teardown deadlock that hung a
    # baseline rank at exit in 2 of ~40 runs; trainguard.resilient.group.end_default_group).
    dist.barrier()
    time.sleep(0.1)
    dist.destroy_process_group()


def save_torch(state: dict[str, Any], ckpt_file: Path) -> None:
    """Rank 0's checkpoint: a temporary file, then a rename."""
    tmp = ckpt_file.with_name(".checkpoint.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, ckpt_file)


def per_rank_batch(global_batch: int | None, world: int) -> int:
    """Each rank's samples per step: ``BATCH``, or the global batch split over the world."""
    if global_batch is None:
        return BATCH
    return batch_split(global_batch, world).per_rank


def device_ids(device: torch.device) -> list[int] | None:
    """DDP's ``device_ids`` for a model on ``device``."""
    return [device.index] if device.type == "cuda" and device.index is not None else None


def main_resilient(
    net: torch.nn.Module, optim: torch.optim.Optimizer, args: Any, device: torch.device
) -> None:
    """``--ckpt resilient``: the same steps in ``@restartable``; an attempt is an incarnation."""
    import trainguard.resilient as resilient
    from trainguard.checkpoint import RankedCheckpointer

    # Made once the rank is known (a spare learns it late), again when a scaling in place
    # changes the rank or the world size.
    checkpointers = RankedCheckpointer()
    checkpointer = checkpointers.get

    def snapshot(steps: int) -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": optim.state_dict(), "steps": steps}

    def from_checkpoint() -> int | None:
        saved = snapshot(0)
        steps: int | None = checkpointer().load_latest(saved)
        if steps is not None:
            net.load_state_dict(saved["model"])
            optim.load_state_dict(saved["optim"])
        return steps

    @resilient.restartable(
        resilient.TrainState(net, optim),
        fallback=from_checkpoint,
        config=resilient.ResilientConfig(backend=args.backend),
    )
    def train(run: resilient.Run) -> None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        recorder = Recorder(
            args.out,
            run.rank,
            run.world_size,
            f"{run_id}.{run.attempt}",
            args.log_all_ranks,
            device,
            per_rank_batch(args.global_batch, run.world_size),
            args.elastic,
        )
        # A new DDP per attempt: a new process group.
        model = DistributedDataParallel(net, device_ids=device_ids(device))
        try:
            for completed in range(run.start_step, args.steps):
                step = completed + 1  # steps are numbered from 1 here, from 0 in run
                recorder.step(step, model, optim, args.step_sleep)
                run.completed(completed)
                checkpointer().save(step, snapshot(step))
        finally:
            recorder.close()
        dist.barrier()  # every rank done before any tears its group down

    train()
    checkpointers.close()


if __name__ == "__main__":
    main()
