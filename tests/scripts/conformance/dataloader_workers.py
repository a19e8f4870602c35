"""A DataLoader with worker processes and pin_memory."""

import os
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")  # pin_memory without an accelerator warns, per process
if __name__ == "__main__":
    data = TensorDataset(torch.arange(64, dtype=torch.float32).view(32, 2))
    loader = DataLoader(data, batch_size=4, num_workers=2, pin_memory=True)
    total = sum(float(batch.sum()) for (batch,) in loader)
    print(f"sum {total}")
    Path(os.environ["OUT"], "result-0.txt").write_text(str(total))
