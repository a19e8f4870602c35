"""The torchrun tutorial's shape: a Trainer object, local to main(), holds the DDP model;
main() destroys the process group and returns (the model is freed right after).

    ddp_object.py [EPOCHS [SAMPLES]]     (the tutorial: 4 epochs of 2048 samples)

Like the tutorial, nothing lets go of the GIL between the last step and ``main()``'s
return (no print, no file written: the weights are written at exit), which is what
makes the race in trainguard/agent/script_end.py likely."""

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Data(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.items = [
            (torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class Trainer:
    def __init__(self, model, data, optimizer) -> None:
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.data = data
        self.optimizer = optimizer

    def train(self, epochs: int) -> None:
        for epoch in range(epochs):
            print(f"[rank{self.rank}] epoch {epoch}", flush=True)
            self.data.sampler.set_epoch(epoch)
            for source, targets in self.data:
                self.optimizer.zero_grad()
                F.mse_loss(self.model(source), targets).backward()
                self.optimizer.step()


WEIGHTS: list[float] = []


def main(epochs: int, samples: int) -> None:
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    data = Data(samples)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
    trainer = Trainer(model, loader, optimizer)
    result = Path(os.environ["OUT"], f"result-{trainer.rank}.txt")
    atexit.register(lambda: result.write_text(repr(WEIGHTS)))
    trainer.train(epochs)
    WEIGHTS.extend(round(v, 5) for v in model.weight.detach().flatten().tolist())
    destroy_process_group()


if __name__ == "__main__":
    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    main(epochs, samples)
