"""Train a small GPT with DDP on a synthetic Markov-chain token stream.

Runs under torchrun (`torchrun --standalone --nproc-per-node 4 examples/gpt/train.py`),
under trainguard, or as a single process (`python examples/gpt/train.py`). It checkpoints
and resumes by itself, and with the same flags and world size it is bit-for-bit
deterministic, also across an interruption followed by a resume from a checkpoint.

On a CUDA machine each worker trains on ``cuda:LOCAL_RANK`` (``--device``, ``--backend``:
see :func:`choose_device`); elsewhere on the CPU.
"""

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# model.py and data.py sit beside this file; also when run as `python -m` or via runpy.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import DataError, MarkovSpec, ensure_token_file, get_batch, open_tokens

# isort: split
import elastic_batches
from devices import (
    BACKEND_CHOICES,
    BACKEND_ENV,
    DEVICE_CHOICES,
    choose_device,
    cuda_device_count,
    group_backend,
    resolve_backend,
)
from model import GPT, GPTConfig

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
CHECKPOINT_KEYS = ("format", "step", "loss", "model_config", "model", "optimizer", "rng")
DEFAULT_TIMEOUT_SECONDS = 300.0
GRAD_CLIP = 1.0
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be used."""


@dataclass(frozen=True)
class Topology:
    """Where this process sits, from the torchrun environment contract."""

    rank: int
    local_rank: int
    world_size: int
    distributed: bool  # a process group is used (also for a world of one under torchrun)


def read_topology(env: Mapping[str, str] = os.environ) -> Topology:
    def num(name: str, default: int) -> int:
        raw = env.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise SystemExit(f"train.py: error: env {name}={raw!r} is not an integer") from None

    world_size = num("WORLD_SIZE", 1)
    rank = num("RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise SystemExit(f"train.py: error: env RANK={rank} outside WORLD_SIZE={world_size}")
    distributed = world_size > 1 or ("MASTER_ADDR" in env and "WORLD_SIZE" in env)
    return Topology(rank, num("LOCAL_RANK", 0), world_size, distributed)


def default_data_dir() -> Path:
    env = os.environ.get("TRAINGUARD_DATA_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "trainguard-gpt-data"


def default_ckpt_dir() -> Path:
    job_dir = os.environ.get("TRAINGUARD_JOB_DIR")
    if job_dir:
        return Path(job_dir) / "checkpoints"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    return Path(tempfile.gettempdir()) / "trainguard-gpt-ckpt" / run_id


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=3e-4, help="lr at the end of the cosine")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument(
        "--lr-decay-steps", type=int, default=None, help="cosine length (default: --steps)"
    )
    p.add_argument("--seed", type=int, default=0, help="model init and per-step seed")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=20, help="0 disables checkpoints")
    p.add_argument("--ckpt-dir", type=Path, default=None)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--data-tokens", type=int, default=1 << 20, help="length of token stream")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--branching", type=int, default=4, help="successors per token in chain")
    p.add_argument("--save-final", type=Path, default=None, help="write final state_dict here")
    p.add_argument(
        "--resilient",
        action="store_true",
        help="in-process restarts with trainguard.resilient (run under trainguard)",
    )
    p.add_argument(
        "--memory-ckpt-every",
        type=int,
        default=10,
        help="--resilient: trainguard Checkpointer snapshot every N steps (0: none)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help="process-group collective timeout and data wait, in seconds",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="auto: cuda:LOCAL_RANK where CUDA is available, else cpu",
    )
    p.add_argument(
        "--backend",
        type=str.lower,
        choices=BACKEND_CHOICES,
        default=None,
        help=f"process-group backend (default: ${BACKEND_ENV}, else auto): auto is "
        "cpu:gloo,cuda:nccl with CUDA, else gloo; gloo for CPU and CUDA tensors (ranks "
        "may share a GPU); nccl is auto that fails without CUDA",
    )
    p.add_argument("--vocab-size", type=int, default=GPTConfig.vocab_size)
    p.add_argument("--block-size", type=int, default=GPTConfig.block_size)
    p.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    p.add_argument("--n-head", type=int, default=GPTConfig.n_head)
    p.add_argument("--d-model", type=int, default=GPTConfig.d_model)
    p.add_argument("--dropout", type=float, default=GPTConfig.dropout)
    elastic_batches.add_flags(p)  # --global-batch, --log-samples
    args = p.parse_args(argv)
    elastic_batches.check_flags(p, args)

    positive = ["steps", "batch_size", "log_every", "data_tokens", "branching", "threads"]
    positive += ["vocab_size", "block_size", "n_layer", "n_head", "d_model"]
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("ckpt_every", "memory_ckpt_every", "warmup_steps", "step_sleep", "lr", "min_lr"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    if args.lr_decay_steps is not None and args.lr_decay_steps < 1:
        p.error("--lr-decay-steps must be >= 1")
    if args.d_model % args.n_head:
        p.error(f"--d-model ({args.d_model}) must be divisible by --n-head ({args.n_head})")
    if args.branching > args.vocab_size:
        p.error("--branching must be <= --vocab-size")
    if args.data_tokens < 2 * (args.block_size + 1):
        p.error("--data-tokens must be at least twice --block-size + 1")
    if not 0.0 <= args.dropout < 1.0:
        p.error("--dropout must be in [0, 1)")
    try:
        args.backend = resolve_backend(args.backend)
    except ValueError as exc:
        p.error(str(exc))
    return args


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to --lr, then cosine to --min-lr at --lr-decay-steps (1-based step)."""
    if args.warmup_steps and step <= args.warmup_steps:
        return float(args.lr * step / args.warmup_steps)
    decay_steps = args.lr_decay_steps or args.steps
    span = max(1, decay_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    return float(args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr))


def set_determinism(threads: int, cuda: bool) -> None:
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # fixed already once parallel work has run
        torch.set_num_interop_threads(1)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """`torch.save` to a tmp file in the same directory, fsync, then `os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def checkpoint_state(
    step: int,
    loss: float,
    cfg: GPTConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> dict[str, Any]:
    """Only tensors and plain containers, so `torch.load(weights_only=True)` reads it.

    The CUDA RNG state is the training device's only: touching every GPU would make a
    CUDA context on each, from every rank that saves or loads.
    """
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "loss": loss,
        "model_config": cfg.as_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng,
    }


def load_checkpoint(path: Path, cfg: GPTConfig) -> dict[str, Any] | None:
    """The checkpoint at `path`, or None if there is none; CheckpointError if unusable."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != ZIP_MAGIC:
        raise CheckpointError(
            f"checkpoint {path} is not a torch.save archive (starts with {magic!r}); "
            "delete it or pass another --ckpt-dir"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({type(exc).__name__}: {reason}); "
            "delete it or pass another --ckpt-dir"
        ) from None
    if not isinstance(state, dict) or any(k not in state for k in CHECKPOINT_KEYS):
        raise CheckpointError(f"checkpoint {path} lacks keys {list(CHECKPOINT_KEYS)}")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {state['format']!r}")
    if state["model_config"] != cfg.as_dict():
        raise CheckpointError(
            f"checkpoint {path} is for model {state['model_config']}, "
            f"but the flags give {cfg.as_dict()}"
        )
    return state


def log0(topo: Topology, message: str) -> None:
    if topo.rank == 0:
        print(message, flush=True)


def agree_on_step(step: int, topo: Topology, device: torch.device) -> None:
    """Fail clearly when ranks resumed from different steps (e.g. --ckpt-dir not shared)."""
    if not topo.distributed:
        return
    t = torch.tensor([step, -step], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != -t[1].item():
        raise CheckpointError(
            f"ranks resume from different steps ({-int(t[1].item())}..{int(t[0].item())}); "
            "is --ckpt-dir shared by all nodes?"
        )


def ordered_allreduce_hook(
    _state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket by summing the ranks' copies in rank order.

    DDP re-lays out its buckets after a process's first step, and gloo's ring allreduce
    sums an element in an order that depends on its offset in the bucket. A resumed
    process would then round differently from an uninterrupted one (seen at 4 ranks).
    Gathering and summing in rank order makes every element's result layout-independent.

    ``then`` runs its callback also when the all_gather fails (a peer died), and the
    chained future then succeeds with whatever the callback returns: ``reduce`` must
    re-raise the failure, or DDP applies a step summed from unfilled buffers.
    """
    buffer = bucket.buffer()
    world_size = dist.get_world_size()
    gathered = [torch.empty_like(buffer) for _ in range(world_size)]
    work = dist.all_gather(gathered, buffer, async_op=True)
    assert work is not None

    def reduce(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        done.wait()  # raises the all_gather's error
        total = gathered[0].clone()
        for grad in gathered[1:]:
            total += grad
        return total.div_(world_size)

    return work.get_future().then(reduce)


def global_mean(value: torch.Tensor, topo: Topology) -> float:
    v = value.detach().clone()
    if topo.distributed:
        dist.all_reduce(v)
    return float(v.item()) / topo.world_size


def train_step(
    args: argparse.Namespace,
    step: int,
    topo: Topology,
    tokens: torch.Tensor,
    ddp: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> tuple[float, torch.Tensor]:
    """One optimizer step (1-based ``step``): its batch, lr and seed depend on the step and
    rank only. Returns the lr and this rank's loss."""
    torch.manual_seed(args.seed * 1_000_003 + step * 101 + topo.rank)  # dropout, if any
    x, y = get_batch(
        tokens,
        step=step,
        rank=topo.rank,
        world_size=topo.world_size,
        batch_size=args.batch_size,
        block_size=args.block_size,
        seed=args.seed,
    )
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    _, loss = ddp(x.to(device), y.to(device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return lr, loss


def train(args: argparse.Namespace, topo: Topology, device: torch.device) -> None:
    cfg = GPTConfig(
        args.vocab_size, args.block_size, args.n_layer, args.n_head, args.d_model, args.dropout
    )
    spec = MarkovSpec(args.vocab_size, args.branching, args.data_tokens, args.data_seed)
    data_dir = args.data_dir or default_data_dir()
    ckpt_dir = args.ckpt_dir or default_ckpt_dir()
    ckpt_path = ckpt_dir / CHECKPOINT_FILE

    path = ensure_token_file(data_dir, spec, create=topo.local_rank == 0, timeout=args.timeout)
    tokens = open_tokens(path, spec.num_tokens)

    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    step, last_loss = 0, float("nan")
    state = load_checkpoint(ckpt_path, cfg)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        cuda_rng = state["rng"].get("cuda")
        if device.type == "cuda" and isinstance(cuda_rng, torch.Tensor):
            torch.cuda.set_rng_state(cuda_rng, device)
        step, last_loss = int(state["step"]), float(state["loss"])
        del state
    agree_on_step(step, topo, device)
    if step:
        log0(topo, f"Resumed from checkpoint at step {step}")

    ddp: nn.Module = model
    if topo.distributed:
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        ddp.register_comm_hook(None, ordered_allreduce_hook)
    n_params = sum(p.numel() for p in model.parameters())
    log0(
        topo,
        f"Starting training: world_size {topo.world_size}, device {device.type}, "
        f"params {n_params}, at step {step} of {args.steps}, "
        f"global batch {args.batch_size * topo.world_size}, data {path}, "
        f"checkpoints {ckpt_dir}",
    )

    ddp.train()
    interval_start, interval_steps = time.perf_counter(), 0
    while step < args.steps:
        step += 1
        lr, loss = train_step(args, step, topo, tokens, ddp, model, optimizer, device)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        interval_steps += 1

        if step % args.log_every == 0 or step == args.steps:
            last_loss = global_mean(loss, topo)
            now = time.perf_counter()
            speed = interval_steps * args.batch_size * topo.world_size / (now - interval_start)
            log0(
                topo,
                f"Batch {step} Loss: {last_loss:.5f}, Speed: {speed:.2f} samples/sec, lr: {lr:.6f}",
            )
            interval_start, interval_steps = now, 0

        if args.ckpt_every and step % args.ckpt_every == 0 and topo.rank == 0:
            saved = checkpoint_state(step, last_loss, cfg, model, optimizer, device)
            save_checkpoint(ckpt_path, saved)
            log0(topo, f"Completed checkpoint at step {step}")

    if args.save_final is not None and topo.rank == 0:
        save_checkpoint(args.save_final, model.state_dict())
    log0(topo, f"Training complete: step {step}, final loss {last_loss:.5f}")
    if topo.distributed:
        # All ranks done before any tears its group down: gloo (torch 2.13) sometimes
        # aborts a rank at exit otherwise ("terminate called without an active exception").
        # On CUDA the device is set (main), so an NCCL barrier would use this rank's GPU.
        dist.barrier()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    topo = read_topology()
    try:
        device = choose_device(args.device, topo.local_rank, args.backend, cuda_device_count())
        backend = group_backend(args.backend, device)
    except ValueError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    set_determinism(args.threads, device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any collective: NCCL uses the current device
    if args.resilient:  # the wrapper makes the process group, once per attempt
        from resilient_mode import run_resilient

        run_resilient(args, topo.local_rank, device)
        return 0
    if topo.distributed:
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        train(args, topo, device)
    except (CheckpointError, DataError) as exc:
        print(f"train.py: error (rank {topo.rank}): {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if topo.distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
