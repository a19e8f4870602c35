"""--device and --backend of the GPT example and the benchmark's training script (CPU only).

Which device a worker takes (``cuda:LOCAL_RANK``, shared GPUs with gloo, errors NCCL
would give later) is a pure function of the flags, LOCAL_RANK and the visible GPUs, so it
is checked here without one; the process tests run 1-rank gloo groups on the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest
import torch

from trainguard.collectives import BackendChoice, backend_string

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the bench package lives at the top of the repository
    sys.path.insert(0, str(REPO))

from bench import train as bench_train  # noqa: E402

GPT_TRAIN = REPO / "examples" / "gpt" / "train.py"
BENCH_TRAIN = REPO / "bench" / "train.py"
RUN_TIMEOUT = 60.0
CPU = torch.device("cpu")
ChooseDevice = Callable[[str, int, str, int], torch.device]


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpt_train_backend", GPT_TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["gpt", "bench"])
def choose_device(request: pytest.FixtureRequest, gpt: ModuleType) -> ChooseDevice:
    """Both scripts' ``choose_device``: they must agree."""
    if request.param == "gpt":
        return cast(ChooseDevice, gpt.choose_device)
    return bench_train.choose_device


@pytest.fixture
def no_backend_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TRAINGUARD_BACKEND", raising=False)
    yield


# --- choose_device -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "local_rank", "backend", "cuda_count", "expected"),
    [
        # No GPU: auto is the CPU, whatever the (non-NCCL) backend and rank.
        ("auto", 0, "auto", 0, CPU),
        ("auto", 3, "gloo", 0, CPU),
        ("cpu", 1, "auto", 0, CPU),
        # GPUs: cuda:LOCAL_RANK.
        ("auto", 0, "auto", 1, cuda(0)),
        ("auto", 3, "auto", 4, cuda(3)),
        ("cuda", 2, "nccl", 4, cuda(2)),
        ("auto", 1, "gloo", 2, cuda(1)),
        # A CPU loop on a CUDA machine.
        ("cpu", 0, "auto", 8, CPU),
        ("cpu", 5, "gloo", 1, CPU),
        # gloo with more local ranks than GPUs: ranks share them.
        ("auto", 1, "gloo", 1, cuda(0)),
        ("cuda", 3, "gloo", 1, cuda(0)),
        ("auto", 5, "gloo", 2, cuda(1)),
        ("auto", 4, "gloo", 2, cuda(0)),
    ],
)
def test_choose_device(
    choose_device: ChooseDevice,
    requested: str,
    local_rank: int,
    backend: str,
    cuda_count: int,
    expected: torch.device,
) -> None:
    assert choose_device(requested, local_rank, backend, cuda_count) == expected


@pytest.mark.parametrize(
    ("requested", "local_rank", "backend", "cuda_count", "message"),
    [
        ("cuda", 0, "auto", 0, "no CUDA device is visible"),
        ("cuda", 0, "gloo", 0, "no CUDA device is visible"),
        ("auto", 0, "nccl", 0, "nccl needs CUDA tensors, but no CUDA device"),
        ("cpu", 0, "nccl", 2, "nccl needs CUDA tensors, but --device cpu"),
        # NCCL (auto or nccl on a CUDA machine) refuses two ranks on one GPU.
        ("auto", 1, "auto", 1, "LOCAL_RANK=1 has no GPU of its own .*--backend gloo"),
        ("cuda", 2, "nccl", 2, "LOCAL_RANK=2 has no GPU of its own"),
        ("auto", -1, "auto", 1, "negative"),
        ("tpu", 0, "auto", 1, "--device='tpu'"),
        ("auto", 0, "mpi", 1, "--backend='mpi'"),
    ],
)
def test_choose_device_rejects(
    choose_device: ChooseDevice,
    requested: str,
    local_rank: int,
    backend: str,
    cuda_count: int,
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        choose_device(requested, local_rank, backend, cuda_count)


# --- backends ----------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "gloo", "nccl"])
@pytest.mark.parametrize("device", [CPU, cuda(0)])
def test_group_backend_is_trainguards_rule(
    gpt: ModuleType, monkeypatch: pytest.MonkeyPatch, choice: str, device: torch.device
) -> None:
    """With trainguard installed and without it (the default mode needs torch only)."""
    try:
        expected: str | None = backend_string(cast(BackendChoice, choice), device.type == "cuda")
    except ValueError:
        expected = None
    for trainguard_missing in (False, True):
        if trainguard_missing:
            monkeypatch.setitem(sys.modules, "trainguard.collectives", None)  # ImportError
        if expected is None:
            with pytest.raises(ValueError, match="nccl"):
                gpt.group_backend(choice, device)
        else:
            assert gpt.group_backend(choice, device) == expected


def test_group_backends_of_the_scripts(gpt: ModuleType) -> None:
    assert gpt.group_backend("auto", CPU) == "gloo"
    assert gpt.group_backend("gloo", cuda(0)) == "gloo"
    assert gpt.group_backend("auto", cuda(1)) == "cpu:gloo,cuda:nccl"
    assert gpt.group_backend("nccl", cuda(0)) == "cpu:gloo,cuda:nccl"


def test_resolve_backend(gpt: ModuleType) -> None:
    env = {"TRAINGUARD_BACKEND": " GLOO "}
    assert gpt.resolve_backend(None, {}) == "auto"
    assert gpt.resolve_backend(None, env) == "gloo"
    assert gpt.resolve_backend("nccl", env) == "nccl"  # the flag wins
    with pytest.raises(ValueError, match="env TRAINGUARD_BACKEND='mpi'"):
        gpt.resolve_backend(None, {"TRAINGUARD_BACKEND": "mpi"})
    with pytest.raises(ValueError, match="--backend='mpi'"):
        gpt.resolve_backend("mpi", {})


# --- argument parsing --------------------------------------------------------------------


@pytest.mark.usefixtures("no_backend_env")
def test_gpt_flags(gpt: ModuleType) -> None:
    args = gpt.parse_args([])
    assert (args.device, args.backend) == ("auto", "auto")
    args = gpt.parse_args(["--device", "cpu", "--backend", "GLOO"])
    assert (args.device, args.backend) == ("cpu", "gloo")
    assert gpt.parse_args(["--backend", "nccl", "--device", "cuda"]).backend == "nccl"


@pytest.mark.usefixtures("no_backend_env")
def test_bench_flags() -> None:
    args = bench_train.parse_args(["--out", "x"])
    assert (args.device, args.backend, args.ckpt) == ("auto", "auto", "none")
    args = bench_train.parse_args(["--out", "x", "--device", "cpu", "--backend", "gloo"])
    assert (args.device, args.backend) == ("cpu", "gloo")


@pytest.mark.parametrize("parse", ["gpt", "bench"])
def test_backend_flag_defaults_to_the_env(
    gpt: ModuleType, monkeypatch: pytest.MonkeyPatch, parse: str
) -> None:
    def parse_args(*argv: str) -> argparse.Namespace:
        if parse == "gpt":
            return cast(argparse.Namespace, gpt.parse_args(list(argv)))
        return bench_train.parse_args(["--out", "x", *argv])

    monkeypatch.setenv("TRAINGUARD_BACKEND", "gloo")
    assert parse_args().backend == "gloo"
    assert parse_args("--backend", "auto").backend == "auto"
    monkeypatch.setenv("TRAINGUARD_BACKEND", "mpi")
    with pytest.raises(SystemExit):
        parse_args()


@pytest.mark.parametrize("parse", ["gpt", "bench"])
@pytest.mark.parametrize("argv", [["--backend", "mpi"], ["--device", "tpu"]])
def test_bad_flags_are_usage_errors(
    gpt: ModuleType, capsys: pytest.CaptureFixture[str], parse: str, argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        if parse == "gpt":
            gpt.parse_args(argv)
        else:
            bench_train.parse_args(["--out", "x", *argv])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bench_device_ids() -> None:
    assert bench_train.device_ids(CPU) is None
    assert bench_train.device_ids(cuda(3)) == [3]


def test_cpu_checkpoint_has_no_cuda_rng(gpt: ModuleType) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = gpt.GPTConfig()
    state = gpt.checkpoint_state(3, 1.5, cfg, model, optimizer, CPU)
    assert set(state["rng"]) == {"torch"}
    assert state["step"] == 3


# --- 1-rank runs on the CPU --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_rank_env() -> dict[str, str]:
    """A torchrun-like env for a world of one (a process group, no launcher)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_")) and k != "LOCAL_RANK"
    }
    env.update(
        # Its own memory tier: the default (/dev/shm/.../local) is shared by every plain run.
        TRAINGUARD_CHECKPOINT_MEMORY_DIR=tempfile.mkdtemp(prefix="tg-test-memory-"),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="1",
        RANK="0",
        LOCAL_RANK="0",
        CUDA_VISIBLE_DEVICES="",  # CPU only, also on a machine with a GPU
    )
    return env


SMALL_GPT = [
    *("--steps", "2", "--ckpt-every", "2", "--n-layer", "1", "--d-model", "16"),
    *("--n-head", "2", "--block-size", "16", "--vocab-size", "32", "--data-tokens", "4096"),
]


def run_script(script: Path, tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *(str(a) for a in args)],
        cwd=tmp_path,
        env=one_rank_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


@pytest.mark.e2e
def test_gpt_runs_one_rank_on_gloo(tmp_path: Path) -> None:
    done = run_script(
        GPT_TRAIN,
        tmp_path,
        *SMALL_GPT,
        *("--backend", "gloo", "--device", "cpu"),
        *("--data-dir", tmp_path / "data", "--ckpt-dir", tmp_path / "ckpt"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Starting training: world_size 1, device cpu,")
    assert [line.split(" Loss")[0] for line in lines if line.startswith("Batch ")] == [
        "Batch 1",
        "Batch 2",
    ]
    assert "Completed checkpoint at step 2" in lines
    assert lines[-1].startswith("Training complete: step 2, final loss ")


@pytest.mark.e2e
def test_gpt_nccl_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    done = run_script(GPT_TRAIN, tmp_path, *SMALL_GPT, "--backend", "nccl")
    assert done.returncode == 2
    assert "train.py: error: --backend nccl needs CUDA tensors" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.e2e
def test_bench_runs_one_rank_on_gloo(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_script(
        BENCH_TRAIN,
        tmp_path,
        *("--steps", "2", "--hidden", "8", "--out", out, "--backend", "gloo"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = re.compile(r"^Batch (\d+) Loss: \d+\.\d{5}, Speed: \d+\.\d samples/sec$")
    assert [int(m.group(1)) for s in done.stdout.splitlines() if (m := line.match(s))] == [1, 2]
    records = (out / "steps.txt").read_text().splitlines()
    assert [r.split()[:2] for r in records] == [["none.0", "1"], ["none.0", "2"]]


@pytest.mark.e2e
def test_gpt_resilient_runs_one_rank_on_gloo(tmp_path: Path) -> None:
    """Plain torchrun env, no trainguard job: one attempt on a group of ResilientConfig's."""
    done = run_script(
        GPT_TRAIN,
        tmp_path,
        *SMALL_GPT,
        *("--resilient", "--memory-ckpt-every", "0", "--backend", "gloo"),
        *("--data-dir", tmp_path / "data"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "Attempt 0: training from step 0 (state from none), world_size 1, device cpu"
    )
    assert [line.split(" Loss")[0] for line in lines if line.startswith("Batch ")] == [
        "Batch 1",
        "Batch 2",
    ]
    assert lines[-1] == "Training complete: step 2"
