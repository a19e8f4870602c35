"""`train.py --resilient --global-batch G`: the same G samples per step at any world size.

The run's samples are numbered as one epoch of ``steps * G``: sample ``k`` belongs to
step ``k // G + 1`` (steps are numbered from 1) and is window ``k % G`` of the G windows
that step draws (:func:`data.batch_starts`, as :func:`data.get_batch` draws the
``batch_size * world_size`` of the default mode). Each attempt of the resilient wrapper
splits G over its world (``run.batch_split``: a micro-batch of at most ``--batch-size``
per rank, and as many accumulation steps as it takes) and deals the rest of the epoch
(``run.shard``). Micro-batch ``m`` of step ``s`` is the ``per_rank * world_size``
samples from ``(s - 1) * G + m * per_rank * world_size`` on, and rank ``r`` takes the
``r``-th contiguous ``per_rank`` of them. So every step's gradient is the mean over the same G
samples whatever the world size, and with G == ``batch_size * world_size`` (one
accumulation step) a rank's samples, and its training, are those of the default mode.

Dropout (off by default) is seeded per micro-batch from its position in the step, so its
masks depend on the world size; everything else does not (up to the rounding of the sums).

Imported by train.py for its flags: it needs torch and data.py only (trainguard just for
type checking).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from data import batch_starts, windows_at

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.elastic import BatchSplit, EpochShard
    from trainguard.resilient import Run

SAMPLES_LINE = re.compile(
    r"^Samples step (?P<step>\d+) world (?P<world>\d+): \[(?P<first>\d+), (?P<end>\d+)\) "
    r"rank (?P<rank>\d+): (?P<ranges>none|\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)$"
)
"""A ``--log-samples`` line (see :func:`samples_line`)."""


class ElasticBatchError(ValueError):
    """The global batch cannot be split over this attempt's world."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="--resilient: sequences per optimizer step over all ranks, kept at any world "
        "size (per-rank micro-batches of at most --batch-size, gradient accumulation)",
    )
    parser.add_argument(
        "--log-samples",
        action="store_true",
        help="--global-batch: every rank prints each step's sample indices",
    )


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.global_batch is None:
        if args.log_samples:
            parser.error("--log-samples needs --global-batch")
        return
    if not args.resilient:
        parser.error("--global-batch needs --resilient (elastic training is resilient mode's)")
    if args.global_batch < 1:
        parser.error("--global-batch must be >= 1")


def step_of(sample: int, global_batch: int) -> tuple[int, int]:
    """(step, window): the 1-based step that sample ``sample`` belongs to, and its window."""
    step, window = divmod(sample, global_batch)
    return step + 1, window


def sample_batch(
    tokens: torch.Tensor, samples: Sequence[int], *, global_batch: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``samples`` (any steps), in their order."""
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    for step, group in itertools.groupby(samples, key=lambda k: step_of(k, global_batch)[0]):
        starts = batch_starts(
            tokens, step=step, count=global_batch, block_size=block_size, seed=seed
        )
        picked = torch.tensor([step_of(k, global_batch)[1] for k in group], dtype=torch.long)
        x, y = windows_at(tokens, starts[picked], block_size)
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


@dataclass(frozen=True)
class ElasticPlan:
    """One attempt's split of the global batch and its rank's share of the run's samples."""

    split: BatchSplit
    shard: EpochShard
    start_step: int
    """Steps completed before the attempt (``run.start_step``)."""

    def step_samples(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of (1-based) step ``step``: one list of samples each."""
        accumulation = self.split.accumulation_steps
        first = (step - 1 - self.start_step) * accumulation
        return [self.shard.batch(first + m) for m in range(accumulation)]


def plan_attempt(run: Run, global_batch: int, max_per_rank: int, steps: int) -> ElasticPlan:
    """The plan of attempt ``run`` of a ``steps``-step run; ElasticBatchError if ``global_batch``
    does not split evenly over its world."""
    try:
        split = run.batch_split(global_batch, max_per_rank=max_per_rank)
    except ValueError as exc:
        raise ElasticBatchError(str(exc)) from None
    return ElasticPlan(split, run.shard(steps * global_batch, split), run.start_step)


def elastic_step(
    args: argparse.Namespace,
    step: int,
    plan: ElasticPlan,
    tokens: torch.Tensor,
    ddp: DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    lr: float,
    grad_clip: float,
) -> tuple[torch.Tensor, list[int]]:
    """One optimizer step at ``lr`` over ``plan``'s micro-batches of ``step``: gradients
    accumulate locally, and the last micro-batch's backward averages them over the ranks
    (DDP's comm hook). Returns the mean loss of this rank's samples, and the samples."""
    micro_batches = plan.step_samples(step)
    accumulation = len(micro_batches)
    step_first = (step - 1) * plan.split.global_batch
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    for m, samples in enumerate(micro_batches):
        position = (samples[0] - step_first) // plan.split.per_rank  # rank r of m: m*W + r
        torch.manual_seed(args.seed * 1_000_003 + step * 101 + position)  # dropout, if any
        x, y = sample_batch(
            tokens,
            samples,
            global_batch=plan.split.global_batch,
            block_size=args.block_size,
            seed=args.seed,
        )
        with contextlib.nullcontext() if m == accumulation - 1 else ddp.no_sync():
            _, loss = ddp(x.to(device), y.to(device))
            loss = loss / accumulation
            loss.backward()
        total += loss.detach()
    nn.utils.clip_grad_norm_(ddp.module.parameters(), grad_clip)
    optimizer.step()
    return total, [k for samples in micro_batches for k in samples]


def compact_ranges(samples: Iterable[int]) -> str:
    """Runs of consecutive indices as inclusive ``a-b`` (``a`` alone for one), joined by
    commas in the given order: ``196-199,208-211``; ``none`` for no samples."""
    runs: list[list[int]] = []
    for k in samples:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


def parse_ranges(text: str) -> list[int]:
    """The indices of a :func:`compact_ranges` text."""
    if text == "none":
        return []
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def elastic_line(split: BatchSplit) -> str:
    """Rank 0's line at the start of every attempt."""
    return (
        f"Elastic: world {split.world_size}, global batch {split.global_batch} = "
        f"{split.per_rank} per rank x {split.accumulation_steps} accumulation x "
        f"{split.world_size} ranks"
    )


def samples_line(step: int, split: BatchSplit, rank: int, samples: Iterable[int]) -> str:
    """Every rank's ``--log-samples`` line for ``step``: its global range ``[c, d)`` and
    this rank's samples (:func:`compact_ranges`). Matches :data:`SAMPLES_LINE`."""
    first = (step - 1) * split.global_batch
    return (
        f"Samples step {step} world {split.world_size}: [{first}, {first + split.global_batch}) "
        f"rank {rank}: {compact_ranges(samples)}"
    )
