"""torch.compile of a small model: dynamo traces it (the template imported dynamo ahead)
and AOT autograd builds its graphs; the aot_eager backend skips only the C++ code
generation, which the worker's start does not change (and costs half a minute here)."""

import os
from pathlib import Path

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
compiled = torch.compile(model, backend="aot_eager")
x = torch.randn(4, 8)
same = torch.allclose(compiled(x), model(x), atol=1e-5)
print(f"compiled matches eager: {same}")
Path(os.environ["OUT"], "result-0.txt").write_text(str(same))
