"""The backend follows the tensors; trainguard's own collectives always have gloo."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from trainguard import collectives
from trainguard.collectives import backend_string, control_group, resolve_choice
from trainguard.resilient import ResilientConfig
from trainguard.resilient.cuda_check import check_cuda
from trainguard.resilient.sync import decode_state, encode_state


def test_backend_choice_comes_from_the_code_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(collectives.BACKEND_ENV, raising=False)
    assert resolve_choice(None) == "auto"
    monkeypatch.setenv(collectives.BACKEND_ENV, " GLOO ")
    assert resolve_choice(None) == "gloo"
    assert resolve_choice("nccl") == "nccl"
    monkeypatch.setenv(collectives.BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="TRAINGUARD_BACKEND='mpi'"):
        resolve_choice(None)
    with pytest.raises(ValueError, match="backend='ucc'"):
        ResilientConfig(backend="ucc")


def test_cpu_tensors_always_have_gloo_and_cuda_tensors_nccl_where_there_is_cuda() -> None:
    assert backend_string("auto", cuda=True) == "cpu:gloo,cuda:nccl"
    assert backend_string("nccl", cuda=True) == "cpu:gloo,cuda:nccl"
    assert backend_string("auto", cuda=False) == "gloo"
    assert backend_string("gloo", cuda=True) == "gloo"  # ranks sharing one GPU
    with pytest.raises(ValueError, match="no CUDA device"):
        backend_string("nccl", cuda=False)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    collectives.forget_control_group()
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_control_group_is_the_default_group_when_it_has_gloo_for_cpu() -> None:
    assert collectives.device_backends() == {"cpu": "gloo", "cuda": "gloo"}
    assert control_group() is None


@pytest.mark.usefixtures("world_of_one")
def test_a_group_without_gloo_for_cpu_gets_a_gloo_control_group_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(collectives, "device_backends", lambda group=None: {"cuda": "nccl"})
    group = control_group()
    assert group is not None and dist.get_backend(group) == "gloo"
    assert control_group() is group
    offers = [torch.empty(2, dtype=torch.int64)]
    dist.all_gather(offers, torch.tensor([1, 7]), group=group)
    assert offers[0].tolist() == [1, 7]
    collectives.forget_control_group()
    assert control_group() is not group  # made again for the next attempt


def test_synced_state_keeps_each_tensor_on_its_device_kind() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()

    class Both:
        def state_dict(self) -> dict[str, object]:
            return {"model": model.state_dict(), "optim": optimizer.state_dict()}

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.loaded = state

    meta, data = encode_state(Both(), 12)
    assert data.device.type == "cpu"
    receiver = Both()
    assert decode_state(receiver, meta, data) == 12
    step = receiver.loaded["optim"]["state"][0]["step"]  # type: ignore[index]
    assert step.device.type == "cpu" and float(step) == 1.0
    assert torch.equal(receiver.loaded["model"]["weight"], model.weight)  # type: ignore[index]


def test_cuda_check_reports_a_hung_or_failing_device_and_passes_a_healthy_one() -> None:
    release = threading.Event()
    started = time.monotonic()
    problem = check_cuda(0.2, probe=lambda: release.wait(30) and None)
    assert problem is not None and "did not finish within 0.2 s" in problem
    assert time.monotonic() - started < 10
    release.set()

    def sticky() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert "illegal memory access" in (check_cuda(5, probe=sticky) or "")
    assert check_cuda(5, probe=lambda: None) is None
    if not torch.cuda.is_available():
        assert check_cuda(5) is None  # never used CUDA: nothing to check
