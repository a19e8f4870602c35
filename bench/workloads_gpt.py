"""``bench/train.py`` with the GPT example's model: the ``workloads`` scenario's GPT side.

The loop, the step records, the launcher's checkpoint modes (``--ckpt torch``,
``trainguard``, ``resilient``) and every flag are ``bench/train.py``'s; only the model,
the optimizer and each step's batch are the GPT example's (``examples/gpt``): its
``GPT`` at the shipped shape (:class:`GPTConfig`'s defaults: 2 layers, d_model 64,
vocab 128, block 64), ``AdamW`` as in ``examples/gpt/train.py`` (at its peak learning
rate, without its schedule and gradient clipping), and ``--gpt-batch`` windows per rank
of its Markov token stream, drawn by ``get_batch`` from (step, rank). The stream is made
in memory (``--gpt-tokens`` tokens), not in a token file. ``--hidden`` is ignored.

    torchrun --standalone --nproc-per-node 2 bench/workloads_gpt.py --steps 5 --out /tmp/gpt
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

BENCH = Path(__file__).resolve().parent
GPT_DIR = BENCH.parent / "examples" / "gpt"
sys.path.insert(0, str(BENCH.parent))  # the bench package, also when run through runpy

from bench import train  # noqa: E402

GPT_BATCH = 8  # sequences per rank per step: examples/gpt/train.py's --batch-size default
GPT_TOKENS = 1 << 16
GPT_LR = 3e-3
SEED = 0


def _example(name: str) -> ModuleType:
    """``examples/gpt/<name>.py`` as the module ``gpt_<name>`` (its ``train`` is not ours)."""
    spec = importlib.util.spec_from_file_location(f"gpt_{name}", GPT_DIR / f"{name}.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"workloads_gpt.py: error: cannot load {GPT_DIR / name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


model_py = _example("model")
data_py = _example("data")
CONFIG = model_py.GPTConfig()


def _tokens() -> torch.Tensor:
    spec = data_py.MarkovSpec(CONFIG.vocab_size, 4, GPT_TOKENS, SEED)
    tokens: torch.Tensor = data_py.generate_tokens(spec)
    return tokens


class GPTRecorder(train.Recorder):
    """bench/train.py's recorder; each step's loss is the GPT's on its token batch."""

    tokens: torch.Tensor | None = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.batch = GPT_BATCH
        if GPTRecorder.tokens is None:
            GPTRecorder.tokens = _tokens()

    def loss(self, step: int, model: torch.nn.Module) -> torch.Tensor:
        assert GPTRecorder.tokens is not None
        x, y = data_py.get_batch(
            GPTRecorder.tokens,
            step=step,
            rank=self.rank,
            world_size=self.world,
            batch_size=GPT_BATCH,
            block_size=CONFIG.block_size,
            seed=SEED,
        )
        _, loss = model(x.to(self.device), y.to(self.device))
        result: torch.Tensor = loss
        return result


def build(
    argv: list[str] | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, argparse.Namespace, torch.device]:
    args = train.parse_args(argv)
    device = train.pick_device(args)
    torch.manual_seed(SEED)
    net = model_py.GPT(CONFIG).to(device)
    optim = torch.optim.AdamW(net.parameters(), lr=GPT_LR, betas=(0.9, 0.95))
    return net, optim, args, device


def main(argv: list[str] | None = None) -> None:
    train.build = build  # train.main and main_resilient look both up at call time
    train.Recorder = GPTRecorder  # type: ignore[misc]
    train.main(argv)


if __name__ == "__main__":
    main()
