"""`nprocPerNode: gpu | auto` counts the devices this process may use (CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

RESOLVE = (
    "from trainguard.spec import resolve_nproc_per_node\n"
    "from trainguard.spec.load import SpecError\n"
    "try:\n"
    "    print(*(resolve_nproc_per_node(value, 'job.yaml') for value in ('gpu', 'auto')))\n"
    "except SpecError as exc:\n"
    "    print('error', exc)\n"
)


def resolve(visible: str) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_gpu_and_auto_count_the_visible_devices() -> None:
    count = torch.cuda.device_count()
    assert resolve(",".join(str(i) for i in range(count))) == f"{count} {count}"
    assert resolve("0") == "1 1"
    hidden = resolve("")
    assert hidden.startswith("error") and "no CUDA device" in hidden
