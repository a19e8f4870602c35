"""trainguard.elastic: the batch split, the data position, and the scale request.

The pure parts are checked exhaustively over small sizes; `scale_requested` in this
process (no process group), then with 3 real gloo ranks (marked e2e).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace

import pytest

from conftest import SCRIPTS, wait_for
from trainguard.elastic import (
    ELASTIC_FILE_ENV,
    FILE_CHECK_INTERVAL,
    BatchSplit,
    batch_split,
    clear_scale_request,
    elastic_event_detected,
    epoch_order,
    handles_scale_signal,
    scale_requested,
    shard_indices,
)
from trainguard.elastic.request import agreement_device, device_type_for

WORKER = SCRIPTS / "elastic_worker.py"

# --- batch_split ---


def fewest_steps(share: int, max_per_rank: int | None) -> int:
    """The reference: the first accumulation count that divides the share and fits."""
    if max_per_rank is None:
        return 1
    return next(a for a in range(1, share + 1) if share % a == 0 and share // a <= max_per_rank)


def test_batch_split_keeps_the_global_batch_with_the_fewest_accumulation_steps() -> None:
    checked = 0
    for global_batch in range(1, 121):
        for world_size in range(1, global_batch + 1):
            if global_batch % world_size:
                continue
            share = global_batch // world_size
            for max_per_rank in (None, *range(1, share + 2)):
                split = batch_split(global_batch, world_size, max_per_rank)
                assert split.per_rank * split.accumulation_steps * world_size == global_batch
                assert max_per_rank is None or split.per_rank <= max_per_rank
                assert split.accumulation_steps == fewest_steps(share, max_per_rank)
                assert split.micro_step == split.per_rank * world_size
                checked += 1
    assert checked > 5000


def test_batch_split_examples() -> None:
    assert batch_split(256, 4) == BatchSplit(256, 4, 64, 1)
    assert batch_split(256, 4, max_per_rank=16) == BatchSplit(256, 4, 16, 4)
    assert batch_split(96, 4, max_per_rank=10) == BatchSplit(96, 4, 8, 3)
    assert batch_split(96, 3, max_per_rank=10) == BatchSplit(96, 3, 8, 4)
    # A prime share: only one sample a micro-batch fits under 6.
    assert batch_split(14, 2, max_per_rank=6) == BatchSplit(14, 2, 1, 7)


def test_batch_split_refuses_a_world_that_does_not_divide_the_global_batch() -> None:
    with pytest.raises(ValueError, match=r"global batch of 10 .* over 3 ranks \(10 % 3 = 1\)"):
        batch_split(10, 3)
    with pytest.raises(ValueError, match="nearest world sizes that can take it are 2 and 5"):
        batch_split(10, 3)
    with pytest.raises(ValueError, match="nearest world size that can take it is 10"):
        batch_split(10, 12)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 1), ValueError, "global_batch must be >= 1, got 0"),
        ((8, 0), ValueError, "world_size must be >= 1, got 0"),
        ((8, 2, 0), ValueError, "max_per_rank must be >= 1, got 0"),
        ((8.0, 2), TypeError, "global_batch must be an int, got 8.0"),
        ((8, True), TypeError, "world_size must be an int, got True"),
    ],
)
def test_batch_split_refuses_bad_arguments(
    args: tuple[object, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        batch_split(*args)  # type: ignore[arg-type]


# --- shard_indices ---


def test_every_rank_has_the_same_micro_steps_and_they_deal_the_rest_of_the_order() -> None:
    for epoch_len in range(31):
        for world_size in range(1, 6):
            for per_rank in range(1, 5):
                for consumed in range(epoch_len + 1):
                    check_shards(epoch_len, consumed, world_size, per_rank, seed=epoch_len)


def check_shards(epoch_len: int, consumed: int, world_size: int, per_rank: int, seed: int) -> None:
    order = list(epoch_order(epoch_len, seed))
    shards = [
        shard_indices(epoch_len, consumed, rank, world_size, per_rank, seed=seed)
        for rank in range(world_size)
    ]
    micro_step = per_rank * world_size
    steps = len(shards[0])
    assert all(len(shard) == steps for shard in shards)
    assert steps == -(-(epoch_len - consumed) // micro_step)
    dealt: list[int] = []
    for step in range(steps):
        batches = [shard.batch(step) for shard in shards]
        sizes = [len(batch) for batch in batches]
        assert max(sizes) <= per_rank and max(sizes) - min(sizes) <= 1, sizes
        if step < steps - 1:
            assert sizes == [per_rank] * world_size
        for batch in batches:
            dealt.extend(batch)
        # After each micro-step the samples taken are a prefix of the order.
        assert dealt == order[consumed : shards[0].consumed_after(step + 1)]
    assert dealt == order[consumed:]
    assert all(shard.consumed_after(0) == consumed for shard in shards)
    assert [list(shard) for shard in shards] == [
        [shard.batch(step) for step in range(steps)] for shard in shards
    ]
    dropped = shard_indices(epoch_len, consumed, 0, world_size, per_rank, drop_last=True)
    assert len(dropped) == (epoch_len - consumed) // micro_step
    assert all(len(batch) == per_rank for batch in dropped)


def consume(
    epoch_len: int,
    consumed: int,
    world_size: int,
    global_batch: int,
    optimizer_steps: int | None,
    seed: int | None,
) -> tuple[list[int], int]:
    """Every rank's samples over ``optimizer_steps`` (None: to the epoch's end), and the
    ``consumed`` a checkpoint then would hold."""
    split = batch_split(global_batch, world_size, max_per_rank=4)
    shards = [
        shard_indices(epoch_len, consumed, rank, world_size, split.per_rank, seed=seed)
        for rank in range(world_size)
    ]
    micro_steps = len(shards[0])
    if optimizer_steps is not None:
        micro_steps = optimizer_steps * split.accumulation_steps
    used = [i for step in range(micro_steps) for shard in shards for i in shard.batch(step)]
    return used, shards[0].consumed_after(micro_steps)


@pytest.mark.parametrize("epoch_len", [480, 500, 503])
@pytest.mark.parametrize("seed", [None, 11])
def test_an_epoch_across_4_3_4_ranks_uses_each_sample_exactly_once(
    epoch_len: int, seed: int | None
) -> None:
    global_batch = 24  # 4 x 3 x 2 at 4 ranks, 3 x 4 x 2 at 3 (max 4 a rank)
    used: list[int] = []
    consumed = 0
    for world_size, optimizer_steps in ((4, 5), (3, 7), (4, 2), (3, 1), (4, None)):
        taken, consumed = consume(
            epoch_len, consumed, world_size, global_batch, optimizer_steps, seed
        )
        used.extend(taken)
    assert consumed == epoch_len
    counts = Counter(used)
    assert sorted(counts) == list(range(epoch_len))
    assert set(counts.values()) == {1}
    assert (used == sorted(used)) == (seed is None)  # shuffled or not, each once


def test_the_order_is_a_seeded_permutation_the_same_everywhere() -> None:
    assert epoch_order(5) == range(5)
    assert epoch_order(1000, 7) == epoch_order(1000, 7)
    assert sorted(epoch_order(1000, 7)) == list(range(1000))
    assert epoch_order(1000, 7) != epoch_order(1000, 8)
    assert list(epoch_order(1000, 7)) != list(range(1000))
    assert epoch_order(0, 3) == []


def test_an_empty_remainder_has_no_micro_steps() -> None:
    shard = shard_indices(10, 10, 1, 3, 2)
    assert len(shard) == 0 and list(shard) == [] and shard.consumed_after(0) == 10
    with pytest.raises(IndexError):
        shard.batch(0)
    with pytest.raises(ValueError, match=r"consumed_after: 1 not in 0..0"):
        shard.consumed_after(1)


def test_fewer_samples_than_ranks_leave_some_ranks_an_empty_last_batch() -> None:
    batches = [shard_indices(10, 8, rank, 4, 3).batch(0) for rank in range(4)]
    assert batches == [[8], [9], [], []]


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((10, 11, 0, 2, 1), ValueError, "consumed 11 > epoch_len 10"),
        ((10, 0, 2, 2, 1), ValueError, "rank 2 is not in a world of 2"),
        ((10, -1, 0, 2, 1), ValueError, "consumed must be >= 0, got -1"),
        ((10, 0, 0, 0, 1), ValueError, "world_size must be >= 1, got 0"),
        ((10, 0, 0, 2, 0), ValueError, "per_rank must be >= 1, got 0"),
        ((10.0, 0, 0, 2, 1), TypeError, "epoch_len must be an int, got 10.0"),
    ],
)
def test_shard_indices_refuses_bad_arguments(
    args: tuple[object, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        shard_indices(*args)  # type: ignore[arg-type]


def test_a_shard_is_a_data_loader_batch_sampler() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(50))
    shard = shard_indices(50, 6, 1, 2, 4, seed=3, drop_last=True)
    loader = DataLoader(data, batch_sampler=shard)
    assert len(loader) == len(shard) == 5
    assert [batch[0].tolist() for batch in loader] == list(shard)


# --- scale_requested, in this process ---


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No request, no request file, SIGUSR1 as it was before the test."""
    before = signal.getsignal(signal.SIGUSR1)
    monkeypatch.delenv(ELASTIC_FILE_ENV, raising=False)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    clear_scale_request()
    yield
    signal.signal(signal.SIGUSR1, before)
    clear_scale_request()


def until_requested(timeout: float = 30.0) -> int:
    """Calls until `scale_requested` says True; the count."""
    deadline = time.monotonic() + timeout
    calls = 0
    while time.monotonic() < deadline:
        calls += 1
        if scale_requested():
            return calls
        time.sleep(0.005)
    raise AssertionError("scale_requested() never said True")


def test_without_trainguard_it_is_false(fresh: None) -> None:
    assert not any(scale_requested() for _ in range(2000))
    assert not elastic_event_detected(every=5)


def test_the_request_file_is_seen_and_remembered(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = tmp_path / "elastic-request"
    monkeypatch.setenv(ELASTIC_FILE_ENV, str(request))
    assert not scale_requested()
    assert (tmp_path / "elastic-request.armed").exists()  # the agent waits for it to save
    assert not (tmp_path / "elastic-request.agreed").exists()
    request.write_text("")
    time.sleep(FILE_CHECK_INTERVAL)
    until_requested()
    assert (tmp_path / "elastic-request.agreed").exists()  # its exit 0 is a stop, not the end
    request.unlink()
    assert scale_requested() and scale_requested()
    clear_scale_request()
    time.sleep(FILE_CHECK_INTERVAL)
    assert not scale_requested()


def test_sigusr1_asks_once_the_handler_is_installed(fresh: None) -> None:
    assert not handles_scale_signal(os.getpid())
    assert not scale_requested()  # installs the handler
    assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, signal.SIG_IGN)
    assert handles_scale_signal(os.getpid())
    os.kill(os.getpid(), signal.SIGUSR1)
    until_requested()
    assert elastic_event_detected()


def test_an_ignored_sigusr1_is_taken_over(fresh: None) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    scale_requested()
    os.kill(os.getpid(), signal.SIGUSR1)
    until_requested()


def test_a_user_handler_is_kept_with_a_warning(fresh: None) -> None:
    seen: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    signal.signal(signal.SIGUSR1, mine)
    with pytest.warns(RuntimeWarning, match="SIGUSR1 already has a handler"):
        assert not scale_requested()
    assert signal.getsignal(signal.SIGUSR1) is mine
    os.kill(os.getpid(), signal.SIGUSR1)
    wait_for(lambda: seen, timeout=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        assert not any(scale_requested() for _ in range(10))


def test_the_handler_is_installed_from_the_main_thread_only(fresh: None) -> None:
    answers: list[bool] = []
    thread = threading.Thread(target=lambda: answers.append(scale_requested()))
    thread.start()
    thread.join(30)
    assert answers == [False]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    scale_requested()
    assert handles_scale_signal(os.getpid())


@pytest.mark.parametrize("every", [0, -1, True, 1.5])
def test_every_must_be_a_positive_int(fresh: None, every: object) -> None:
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        scale_requested(every=every)  # type: ignore[arg-type]


def test_a_process_that_does_not_catch_sigusr1_is_not_to_be_signalled(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not handles_scale_signal(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait(30)
    assert not handles_scale_signal(sleeper.pid)  # gone


def test_the_agreement_device_follows_the_group_s_backends() -> None:
    assert device_type_for(["cuda", "cpu"]) == "cpu"
    assert device_type_for(["cpu"]) == "cpu"
    assert device_type_for(["cuda"]) == "cuda"
    assert device_type_for(["xpu"]) == "xpu"
    assert device_type_for([]) == "cpu"
    import torch

    gloo = SimpleNamespace(
        group=SimpleNamespace(WORLD=SimpleNamespace(_device_types=[torch.device("cuda"), "cpu"]))
    )
    assert agreement_device(gloo) == torch.device("cpu")
    older = SimpleNamespace(group=SimpleNamespace(WORLD=object()), get_backend=lambda g: "gloo")
    assert agreement_device(older) == torch.device("cpu")


def test_importing_and_using_the_pure_parts_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import trainguard.elastic as e\n"
        "assert not e.scale_requested() and not e.scale_requested(every=3)\n"
        "e.batch_split(8, 2, 2)\n"
        "list(e.shard_indices(10, 3, 1, 2, 2, seed=1))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ELASTIC_FILE_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# --- scale_requested, 3 gloo ranks ---

WORLD = 3


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_three_gloo_ranks_agree_on_the_call_of_a_signal_or_a_file(tmp_path: Path) -> None:
    """One run of tests/scripts/elastic_worker.py's three phases on 3 ranks (torch is
    imported once per process): nothing asked, then SIGUSR1 to rank 1 only, then the
    request file of rank 2 only (ranks 0 and 1 have no TRAINGUARD_ELASTIC_FILE)."""
    out = tmp_path / "out"
    out.mkdir()
    request = tmp_path / "request-2"
    base = {k: v for k, v in os.environ.items() if k != ELASTIC_FILE_ENV}
    base.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen[bytes]] = []

    def ready(phase: str) -> bool:
        return all((out / f"ready-{phase}-{rank}").exists() for rank in range(WORLD))

    try:
        for rank in range(WORLD):
            argv = [sys.executable, str(WORKER), "--out", str(out), "--store", str(out / "store")]
            env = {**base, ELASTIC_FILE_ENV: str(request)} if rank == 2 else base
            with open(out / f"log-{rank}", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [*argv, "--rank", str(rank), "--world", str(WORLD)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        wait_for(lambda: ready("signal") or any(p.poll() is not None for p in procs), 240)
        if ready("signal"):
            time.sleep(0.2)  # mid-loop
            assert handles_scale_signal(procs[1].pid)
            os.kill(procs[1].pid, signal.SIGUSR1)
            wait_for(lambda: ready("file") or any(p.poll() is not None for p in procs), 240)
            time.sleep(0.2)
            request.write_text("")
        codes = [proc.wait(240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    logs = "\n".join((out / f"log-{rank}").read_text() for rank in range(WORLD))
    assert codes == [0] * WORLD, logs
    results = [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(WORLD)]
    assert [result["quiet"] for result in results] == [[]] * WORLD
    signalled = {result["signal"] for result in results}
    assert len(signalled) == 1 and signalled.pop() > 1, results
    filed = {result["file"] for result in results}
    assert len(filed) == 1, results
    call = filed.pop()
    assert call > 1 and (call - 1) % 4 == 0, results
