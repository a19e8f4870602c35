"""A deterministic synthetic token stream, stored as a flat int32 file and read memory-mapped.

The stream comes from a fixed random first-order Markov chain: every token has
`branching` possible successors with skewed probabilities. A model can learn the
transition table, so the loss falls from ln(vocab) towards the chain's entropy.

Batches are a pure function of (seed, step, rank, world size): a resumed run sees
exactly the batches it would have seen, and ranks read disjoint shards of each
global batch.
"""

from __future__ import annotations

import math
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

TOKEN_DTYPE = torch.int32
TOKEN_BYTES = 4
PARALLEL_CHAINS = 256  # chains sampled side by side, then concatenated
WAIT_POLL_SECONDS = 0.1


class DataError(RuntimeError):
    """The token file is missing, malformed, or did not appear in time."""


@dataclass(frozen=True)
class MarkovSpec:
    """Everything the generated stream depends on; all of it is in the file name."""

    vocab_size: int
    branching: int
    num_tokens: int
    seed: int

    @property
    def file_name(self) -> str:
        return (
            f"markov-v{self.vocab_size}-k{self.branching}-n{self.num_tokens}-s{self.seed}-i32.bin"
        )


def generate_tokens(spec: MarkovSpec) -> torch.Tensor:
    """Sample `spec.num_tokens` tokens (int32) from the chain `spec` defines."""
    g = torch.Generator().manual_seed(spec.seed)
    v, k = spec.vocab_size, spec.branching
    successors = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(v)])
    weights = torch.rand(v, k, generator=g) ** 3 + 0.02
    cumulative = weights.cumsum(1) / weights.sum(1, keepdim=True)
    chains = min(PARALLEL_CHAINS, spec.num_tokens)
    length = math.ceil(spec.num_tokens / chains)
    out = torch.empty(chains, length, dtype=TOKEN_DTYPE)
    state = torch.randint(0, v, (chains,), generator=g)
    for t in range(length):
        out[:, t] = state
        u = torch.rand(chains, 1, generator=g)
        choice = (u > cumulative[state]).sum(1).clamp_(max=k - 1)
        state = successors[state, choice]
    return out.reshape(-1)[: spec.num_tokens].contiguous()


def write_token_file(path: Path, tokens: torch.Tensor) -> None:
    """Write `tokens` raw to `path` atomically (unique tmp file, then `os.replace`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    nbytes = tokens.numel() * TOKEN_BYTES
    try:
        with open(tmp, "w+b") as f:
            f.truncate(nbytes)
            with mmap.mmap(f.fileno(), nbytes) as mm:
                view = torch.frombuffer(mm, dtype=TOKEN_DTYPE)
                view.copy_(tokens)
                del view  # release the exported buffer before the mmap closes
                mm.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_token_file(data_dir: Path, spec: MarkovSpec, *, create: bool, timeout: float) -> Path:
    """Return the path of the token file for `spec`, generating it when `create` is set.

    Several processes may create it at once (each writes identical bytes and renames
    atomically). Processes with `create=False` wait up to `timeout` seconds for it.
    """
    path = data_dir / spec.file_name
    if path.exists():
        return path
    if create:
        write_token_file(path, generate_tokens(spec))
        return path
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise DataError(f"token file {path} did not appear within {timeout:.0f} s")
        time.sleep(WAIT_POLL_SECONDS)
    return path


def open_tokens(path: Path, num_tokens: int) -> torch.Tensor:
    """Map the token file read-only (copy-on-write); checks its size first."""
    expected = num_tokens * TOKEN_BYTES
    try:
        actual = path.stat().st_size
    except OSError as exc:
        raise DataError(f"token file {path} cannot be read: {exc}") from None
    if actual != expected:
        raise DataError(
            f"token file {path} has {actual} bytes, expected {expected}; delete it to regenerate"
        )
    return torch.from_file(str(path), shared=False, size=num_tokens, dtype=TOKEN_DTYPE)


def batch_seed(seed: int, step: int) -> int:
    """A per-step seed; distinct steps get unrelated random streams."""
    return (seed * 1_000_003 + step * 7_919 + 17) % (2**63 - 1)


def batch_starts(
    tokens: torch.Tensor, *, step: int, count: int, block_size: int, seed: int
) -> torch.Tensor:
    """The start offsets of step `step`'s `count` windows, drawn from a generator seeded by
    (seed, step): the global batch of that step, in window order."""
    n_windows = tokens.numel() - block_size - 1
    g = torch.Generator().manual_seed(batch_seed(seed, step))
    return torch.randint(0, n_windows, (count,), generator=g)


def windows_at(
    tokens: torch.Tensor, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (int64, shape (len(starts), block_size))."""
    idx = starts[:, None] + torch.arange(block_size + 1)
    window = tokens[idx].long()
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def get_batch(
    tokens: torch.Tensor,
    *,
    step: int,
    rank: int,
    world_size: int,
    batch_size: int,
    block_size: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (int64, shape (batch_size, block_size)) for one rank.

    The global batch of step `step` is `batch_size * world_size` windows at offsets drawn
    from a generator seeded by (seed, step); rank `rank` takes its own contiguous slice.
    """
    starts = batch_starts(
        tokens, step=step, count=batch_size * world_size, block_size=block_size, seed=seed
    )
    return windows_at(tokens, starts[rank * batch_size : (rank + 1) * batch_size], block_size)
