"""`train.py --resilient`: the same training, restartable in process with trainguard.resilient.

When another rank dies, this process keeps its model, optimizer and data: the wrapper
rebuilds the process group, a replacement rank (a hot spare or a new process) takes the
state from a healthy peer, and training goes on at the step that was interrupted. With no
peer holding state (the first start, a full restart) it falls back to trainguard's tiered
checkpoints. Batches depend on (step, rank) only, so the run is the same with or without
faults. Needs trainguard (the default mode of train.py does not).

With ``--global-batch G`` the job may change size between attempts (an elastic job that
trainguard scales in place): each attempt splits G over its world and takes its share of
the run's samples (:mod:`elastic_batches`), so every step averages the same G samples.

``device`` is train.py's choice (``cuda:LOCAL_RANK``, current already, or the CPU); the
wrapper's process groups use ``--backend`` (:class:`trainguard.resilient.ResilientConfig`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import trainguard.resilient as resilient
from trainguard.checkpoint import RankedCheckpointer

# Beside this file (train.py puts this directory on sys.path).
# isort: split
from elastic_batches import (
    ElasticBatchError,
    ElasticPlan,
    elastic_line,
    elastic_step,
    plan_attempt,
    samples_line,
)
from model import GPT, GPTConfig
from train import (
    GRAD_CLIP,
    Topology,
    default_data_dir,
    global_mean,
    lr_at,
    ordered_allreduce_hook,
    save_checkpoint,
    train_step,
)

from data import MarkovSpec, ensure_token_file, open_tokens


def run_resilient(args: argparse.Namespace, local_rank: int, device: torch.device) -> None:
    cfg = GPTConfig(
        args.vocab_size, args.block_size, args.n_layer, args.n_head, args.d_model, args.dropout
    )
    spec = MarkovSpec(args.vocab_size, args.branching, args.data_tokens, args.data_seed)
    path = ensure_token_file(
        args.data_dir or default_data_dir(), spec, create=local_rank == 0, timeout=args.timeout
    )
    tokens = open_tokens(path, spec.num_tokens)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    state = resilient.TrainState(model=model, optimizer=optimizer)
    # Made once the rank is known (a spare learns it late), again when an elastic scaling
    # in place changes the rank or the world size.
    checkpoints = RankedCheckpointer()
    checkpointer = checkpoints.get
    ranks: list[int] = []

    def snapshot(steps: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "steps": steps}

    def from_checkpoint() -> int | None:
        """No rank holds state: the tiered checkpoints (memory, replica, durable) do."""
        saved = snapshot(0)
        steps = checkpointer().load_latest(saved)
        if steps is not None:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optim"])
        return steps

    config = resilient.ResilientConfig(backend=args.backend)

    @resilient.restartable(state, fallback=from_checkpoint, config=config)
    def train(run: resilient.Run) -> None:
        topo = Topology(run.rank, run.local_rank, run.world_size, distributed=True)
        ranks[:] = [run.rank]
        plan: ElasticPlan | None = None
        if args.global_batch is not None:
            plan = plan_attempt(run, args.global_batch, args.batch_size, args.steps)
        ddp = DistributedDataParallel(  # a new one per attempt: a new process group
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        ddp.register_comm_hook(None, ordered_allreduce_hook)
        ddp.train()
        if run.rank == 0:
            print(
                f"Attempt {run.attempt}: training from step {run.start_step} "
                f"(state from {run.state_source}), world_size {run.world_size}, "
                f"device {device.type}",
                flush=True,
            )
            if plan is not None:
                print(elastic_line(plan.split), flush=True)
        for completed in range(run.start_step, args.steps):
            step = completed + 1  # train.py numbers steps from 1
            if plan is None:
                lr, loss = train_step(args, step, topo, tokens, ddp, model, optimizer, device)
            else:
                lr = lr_at(step, args)
                loss, samples = elastic_step(
                    args, step, plan, tokens, ddp, optimizer, device, lr=lr, grad_clip=GRAD_CLIP
                )
                if args.log_samples:  # before completed(), which may end the attempt
                    print(samples_line(step, plan.split, run.rank, samples), flush=True)
            run.completed(completed)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step % args.log_every == 0 or step == args.steps:
                mean = global_mean(loss, topo)
                if run.rank == 0:
                    print(f"Batch {step} Loss: {mean:.5f}, lr: {lr:.6f}", flush=True)
            if args.memory_ckpt_every and step % args.memory_ckpt_every == 0:
                checkpointer().save(step, snapshot(step))
        dist.barrier()  # all ranks done before the group goes (gloo aborts a rank otherwise)

    try:
        train()
    except ElasticBatchError as exc:  # every rank of the attempt, before any collective
        print(f"train.py: error (rank {ranks[0]}): {exc}", file=sys.stderr, flush=True)
        if dist.is_initialized():  # plain torchrun's group (trainguard's is dropped already)
            dist.barrier()  # gloo aborts a rank whose peers left first
            dist.destroy_process_group()
        checkpoints.close()
        raise SystemExit(2) from None
    rank = ranks[0]
    if args.save_final is not None and rank == 0:
        save_checkpoint(args.save_final, model.state_dict())
    if rank == 0:
        print(f"Training complete: step {args.steps}", flush=True)
    checkpoints.close()
