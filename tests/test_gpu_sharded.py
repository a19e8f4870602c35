"""An FSDP2 model's checkpoint on a GPU: SIGKILLed, resumed bit-identical to a plain run.

``tests/scripts/sharded_train.py --device cuda`` under torchrun, one rank on one GPU
(``fully_shard`` on a 1-D CUDA mesh, NCCL): its DTensor parameters and Adam's moments
are CUDA tensors, copied into the memory tier's page-locked slots on a side stream and
back into the local shards. Runs where CUDA is (``make gpu-check``); skipped elsewhere.
The same script on gloo (CPU, 2-4 ranks) is tests/test_checkpoint_sharded.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch

from conftest import SCRIPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One rank of the script on GPU 0; the process group is killed on a timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TORCHELASTIC"))}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    argv += [str(SCRIPTS / "sharded_train.py"), "--device", "cuda", *args]
    proc = subprocess.Popen(
        argv,
        env={**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    data: dict[str, Any] = json.loads(lines[-1])
    return data


def test_fsdp2_on_cuda_resumes_bit_identical_after_a_sigkill(shm: str) -> None:
    plain = _result(_torchrun("--plain"))
    tiers = ["--memory-dir", f"{shm}/memory", "--durable-url", f"{shm}/durable"]
    killed = _torchrun(*tiers, "--kill-at", "3")
    assert killed.returncode != 0, "the rank SIGKILLs itself at step 3"
    resumed = _result(_torchrun(*tiers))
    assert (resumed["start"], resumed["tier"]) == (3, "memory")
    assert resumed["digest"] == plain["digest"]
    # A new node (its memory gone) restores the last step from the durable tier.
    again = _result(_torchrun("--memory-dir", f"{shm}/new", "--durable-url", f"{shm}/durable"))
    assert (again["start"], again["tier"], again["digest"]) == (6, "durable", plain["digest"])
