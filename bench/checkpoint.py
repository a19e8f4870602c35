"""Checkpoint save cost: trainguard's memory tier against torch.save and DCP async_save.

    python -m bench.checkpoint --sizes 256,1024 --repeats 3 --out bench/out/checkpoint.json

For each size (MiB of float32 state in 4 tensors), in one process and one run:

- ``trainguard_save_s``: blocking time of ``Checkpointer.save`` (slots pre-faulted by
  ``load_latest``, as in a training script), waiting for the background checksum between
  repetitions so every repetition starts idle;
  interleaved with the memcpy below;
- ``baseline_torch_save_s``: ``torch.save`` to a file on local disk (not /dev/shm),
  plain (no fsync; the data may still be in the page cache when it returns);
- ``baseline_dcp_async_save_s``: blocking time of ``torch.distributed.checkpoint.async_save``
  (gloo group of one, to a local directory), then waiting for its future;
- ``baseline_memcpy_s``: ``dst.copy_(src)`` into pre-allocated, pre-faulted tensors, and
  the copy bandwidth of ``save()`` against it.

``spaced`` (one size, ``--spaced-size``): saves spaced like training steps, by a
Checkpointer that never called ``load_latest`` (its first save faults its own slot in,
and the other slots are prepared in the background). Each of ``--spaced-saves`` rounds
idles ``--spacing`` seconds, times one ``save()`` (never waiting for its background
work), idles again and times a plain copy of the same bytes into pre-faulted tensors.
``spaced_first_save_s`` is the first save; ``spaced_save_s`` the saves after it;
``ratio_spaced_save_vs_memcpy`` their median over the copies' (the goal,
``goal_ratio_spaced_save_vs_memcpy``: at most 1.2).

``per_call`` (each of ``--per-call-sizes``, MB of float32 state in ``--per-call-tensors``
tensors, shaped like a model with an Adam optimizer: per parameter, its two moments and
a 0-dim step; plus plain values, one of them the step): the per-call cost of ``save()``
for small states of many tensors, with one intra-op thread (as each rank of a job with a
rank per core; on a shared 2-core machine two threads' copies stall each other, which
would measure the machine's load, not the call). Per repetition, interleaved:
``per_call_save_s``,
``save()`` blocking (slots pre-faulted by ``load_latest``, the background work waited for,
untimed, after each); ``per_call_copy_s``, a plain ``copy_`` of each tensor into
pre-faulted tensors. ``goal_per_call_save_s``: at most 5 ms.

``cuda`` (each of ``--cuda-sizes``, only with a CUDA device; otherwise the string
``"no CUDA device"``): the state as 4 float32 CUDA tensors, slots pinned by
``load_latest`` and one warm-up save, then per repetition, interleaved, and each timer
started after ``torch.cuda.synchronize()``:

- ``cuda_save_s``: blocking ``save()`` (then ``wait()``, untimed);
- ``cuda_save_nonblocking_s``: ``save(blocking=False)`` until it returns, and
  ``cuda_save_nonblocking_complete_s`` until ``torch.cuda.synchronize()`` returns;
- ``baseline_pinned_copy_s`` / ``baseline_pageable_copy_s``: ``copy_(non_blocking=True)``
  into pre-allocated ``pin_memory`` / plain pre-faulted CPU tensors, then synchronize;
- ``baseline_torch_save_s``: ``torch.save`` of the CUDA state to local disk, once;
- ``cuda_restore_s``: ``load_latest`` into the (zeroed) CUDA state by a new Checkpointer
  on the same memory directory, and ``cuda_restore_identical``: whether every restored
  tensor equals, bit for bit, what was saved.

Times are median, min and max over the repetitions; ``ratio_*`` are trainguard over the
baseline (medians). ``python -m bench`` runs this as its ``checkpoint`` scenario.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TENSORS = 4
PER_CALL_GOAL_S = 0.005
"""save() of a state of up to 16 MB blocks at most this long, however many tensors."""
SPACED_GOAL = 1.2
"""Every save after the first blocks at most this many times a plain pre-faulted copy."""
NO_CUDA = "no CUDA device"


def _stats(times: list[float]) -> dict[str, float]:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def _timed(
    fn: Callable[[], Any], repeats: int, after: Callable[[], Any] | None = None
) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return times


def _state(mib: int, device: str = "cpu") -> dict[str, Any]:
    numel = (mib << 20) // 4 // TENSORS
    return {f"layer{i}": torch.randn(numel, device=device) for i in range(TENSORS)} | {"step": 0}


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state).values())


def _prefaulted_like(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Plain CPU tensors shaped like ``state``'s, every page written once."""
    dst = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in _tensors(state).items()}
    for t in dst.values():
        t.zero_()
    return dst


def _init_gloo() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def bench_size(mib: int, repeats: int, disk_dir: Path, shm_dir: Path) -> dict[str, Any]:
    from trainguard.checkpoint import Checkpointer

    state = _state(mib)
    nbytes = _nbytes(state)
    result: dict[str, Any] = {"bytes": nbytes}

    # trainguard (memory tier only; load_latest pre-faults the slots, as in training) and a
    # plain memcpy into pre-faulted tensors, interleaved so both see the same machine.
    ckpt = Checkpointer(memory_dir=str(shm_dir / f"{mib}"), job_id="bench", environ={})
    ckpt.load_latest(state)
    dst = _prefaulted_like(state)

    def memcpy() -> None:
        for k, t in dst.items():
            t.copy_(state[k])

    tg: list[float] = []
    mc: list[float] = []
    for step in range(1, repeats + 1):
        tg += _timed(functools.partial(ckpt.save, step, state), 1, after=ckpt.wait)
        mc += _timed(memcpy, 1)
    ckpt.close()
    dst.clear()
    shutil.rmtree(shm_dir / f"{mib}", ignore_errors=True)
    result["trainguard_save_s"] = _stats(tg)
    result["baseline_memcpy_s"] = _stats(mc)

    path = disk_dir / f"state-{mib}.pt"
    result["baseline_torch_save_s"] = _stats(
        _timed(lambda: torch.save(state, path), repeats, after=lambda: path.unlink())
    )

    import torch.distributed.checkpoint as dcp

    _init_gloo()
    futures: list[Any] = []
    counter = iter(range(1 << 30))
    dcp_times = _timed(
        lambda: futures.append(
            dcp.async_save(state, checkpoint_id=str(disk_dir / f"dcp-{mib}-{next(counter)}"))
        ),
        repeats,
        after=lambda: futures[-1].result(),
    )
    result["baseline_dcp_async_save_s"] = _stats(dcp_times)

    tg_med = result["trainguard_save_s"]["median"]
    result["trainguard_bandwidth_gbps"] = nbytes / tg_med / 1e9
    result["baseline_memcpy_bandwidth_gbps"] = nbytes / result["baseline_memcpy_s"]["median"] / 1e9
    result["ratio_save_vs_torch_save"] = tg_med / result["baseline_torch_save_s"]["median"]
    result["ratio_save_vs_dcp_async_save"] = tg_med / result["baseline_dcp_async_save_s"]["median"]
    result["ratio_bandwidth_vs_memcpy"] = (
        result["trainguard_bandwidth_gbps"] / result["baseline_memcpy_bandwidth_gbps"]
    )
    return result


def bench_spaced(mib: int, saves: int, spacing: float, shm_dir: Path) -> dict[str, Any]:
    """Saves spaced like training steps by a Checkpointer that never called load_latest,
    each round's save and plain copy both after ``spacing`` seconds idle."""
    from trainguard.checkpoint import Checkpointer

    if saves < 2:
        raise ValueError(f"--spaced-saves must be at least 2, got {saves}")
    state = _state(mib)
    nbytes = _nbytes(state)
    dst = _prefaulted_like(state)

    def memcpy() -> None:
        for k, t in dst.items():
            t.copy_(state[k])

    directory = shm_dir / f"spaced-{mib}"
    ckpt = Checkpointer(memory_dir=str(directory), job_id="bench-spaced", environ={})
    save_times: list[float] = []
    copy_times: list[float] = []
    try:
        for step in range(1, saves + 1):
            time.sleep(spacing)
            start = time.perf_counter()
            saved = ckpt.save(step, state)
            save_times.append(time.perf_counter() - start)
            if not saved:
                raise RuntimeError(f"Checkpointer.save({step}) did not save")
            time.sleep(spacing)
            copy_times += _timed(memcpy, 1)
        ckpt.wait()
    finally:
        ckpt.close()
        dst.clear()
        shutil.rmtree(directory, ignore_errors=True)
    copy_med = statistics.median(copy_times)
    later = _stats(save_times[1:])
    return {
        "size": f"{mib}MiB",
        "bytes": nbytes,
        "saves": saves,
        "spacing_s": spacing,
        "spaced_first_save_s": save_times[0],
        "spaced_save_s": later,
        "spaced_memcpy_s": _stats(copy_times),
        "spaced_save_times_s": save_times,
        "ratio_spaced_save_vs_memcpy": later["median"] / copy_med,
        "ratio_first_save_vs_memcpy": save_times[0] / copy_med,
        "goal_ratio_spaced_save_vs_memcpy": SPACED_GOAL,
    }


def _many_tensors_state(mb: float, tensors: int) -> dict[str, Any]:
    """About ``mb`` MB of float32 in about ``tensors`` tensors, laid out like a model's and
    an Adam optimizer's state dicts (per parameter: its two moments and a 0-dim step)."""
    params = max(1, tensors // 4)
    numel = max(1, int(mb * 1e6) // 4 // (3 * params))
    model = {f"layer{i}.weight": torch.randn(numel) for i in range(params)}
    moments = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(numel),
            "exp_avg_sq": torch.rand(numel),
        }
        for i in range(params)
    }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(params))}]
    return {"model": model, "optim": {"state": moments, "param_groups": groups}, "step": 0}


def bench_per_call(mb: float, tensors: int, repeats: int, shm_dir: Path) -> dict[str, Any]:
    """save() of a small state of many tensors, against a plain copy of each tensor."""
    from bench.workloads_ckpt import tensors as leaves
    from trainguard.checkpoint import Checkpointer

    state = _many_tensors_state(mb, tensors)
    live = list(leaves(state))
    dst = [torch.zeros_like(t) for t in live]  # pre-faulted: every page written
    directory = shm_dir / f"per-call-{mb}"
    ckpt = Checkpointer(memory_dir=str(directory), job_id="bench-per-call", environ={})
    save_s: list[float] = []
    copy_s: list[float] = []

    def copy() -> None:
        for target, source in zip(dst, live, strict=True):
            target.copy_(source)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ckpt.load_latest(state)
        ckpt.save(0, state)  # warm-up (as in training, the first save is not the point)
        ckpt.wait()
        for step in range(1, repeats + 1):
            state["step"] = step
            save_s += _timed(functools.partial(ckpt.save, step, state), 1, after=ckpt.wait)
            copy_s += _timed(copy, 1)
    finally:
        torch.set_num_threads(threads)
        ckpt.close()
        shutil.rmtree(directory, ignore_errors=True)
    nbytes = sum(t.numel() * t.element_size() for t in live)
    save = _stats(save_s)
    return {
        "bytes": nbytes,
        "tensors": len(live),
        "per_call_save_s": save,
        "per_call_copy_s": _stats(copy_s),
        "ratio_per_call_save_vs_copy": save["median"] / statistics.median(copy_s),
        "goal_per_call_save_s": PER_CALL_GOAL_S,
    }


def _synced(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes, started once the device is idle."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _empty_host_cache() -> None:
    """Give the caching host allocator's page-locked blocks back (when torch can)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def bench_cuda_size(mib: int, repeats: int, disk_dir: Path, shm_dir: Path) -> dict[str, Any]:
    """A CUDA state's save (blocking, non-blocking), against device-to-host copies into
    pinned and into pageable memory and torch.save, and its restore from the memory tier."""
    from trainguard.checkpoint import Checkpointer

    state = _state(mib, device="cuda")
    tensors = _tensors(state)
    nbytes = _nbytes(state)
    result: dict[str, Any] = {"bytes": nbytes, "device": torch.cuda.get_device_name()}
    directory = shm_dir / f"cuda-{mib}"
    job_id = "bench-cuda"
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in tensors.items()}
    pageable = _prefaulted_like(state)
    reference = {k: t.clone() for k, t in tensors.items()}  # what every save copies

    def copy_into(dst: dict[str, torch.Tensor]) -> None:
        for k, t in dst.items():
            t.copy_(tensors[k], non_blocking=True)
        torch.cuda.synchronize()

    save_s: list[float] = []
    nonblocking_s: list[float] = []
    complete_s: list[float] = []
    pinned_s: list[float] = []
    pageable_s: list[float] = []
    step = 0
    ckpt = Checkpointer(memory_dir=str(directory), job_id=job_id, environ={})
    try:
        ckpt.load_latest(state)  # nothing to restore: prepares (and pins) every slot
        ckpt.save(step, state)  # warm-up: the side stream, the first event
        ckpt.wait()
        copy_into(pinned)
        copy_into(pageable)
        for _ in range(repeats):
            step += 1
            save_s.append(_synced(functools.partial(ckpt.save, step, state)))
            ckpt.wait()

            step += 1
            torch.cuda.synchronize()
            start = time.perf_counter()
            ckpt.save(step, state, blocking=False)
            nonblocking_s.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            complete_s.append(time.perf_counter() - start)
            ckpt.wait()

            pinned_s.append(_synced(functools.partial(copy_into, pinned)))
            pageable_s.append(_synced(functools.partial(copy_into, pageable)))
        ckpt.wait()
    finally:
        ckpt.close()
    saved_step = step
    result["cuda_save_s"] = _stats(save_s)
    result["cuda_save_nonblocking_s"] = _stats(nonblocking_s)
    result["cuda_save_nonblocking_complete_s"] = _stats(complete_s)
    result["baseline_pinned_copy_s"] = _stats(pinned_s)
    result["baseline_pageable_copy_s"] = _stats(pageable_s)
    del pinned
    _empty_host_cache()

    path = disk_dir / f"cuda-state-{mib}.pt"
    try:
        result["baseline_torch_save_s"] = _stats([_synced(lambda: torch.save(state, path))])
    finally:
        path.unlink(missing_ok=True)

    # Restore: a new Checkpointer on the same directory (as a restarted worker would),
    # into the zeroed state, checked against ``reference`` (the state never changed).
    restore_s: list[float] = []
    inside_s: list[float] = []
    identical = True
    tiers: set[str] = set()
    try:
        for _ in range(repeats):
            for t in tensors.values():
                t.zero_()
            loader = Checkpointer(memory_dir=str(directory), job_id=job_id, environ={})
            try:
                torch.cuda.synchronize()
                start = time.perf_counter()
                restored = loader.load_latest(state)
                restore_s.append(time.perf_counter() - start)
                if loader.last_restore is not None:
                    inside_s.append(loader.last_restore.seconds)
                    tiers.add(loader.last_restore.tier)
            finally:
                loader.close()
            identical = identical and restored == saved_step
            identical = identical and all(torch.equal(t, reference[k]) for k, t in tensors.items())
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result["cuda_restore_s"] = _stats(restore_s)
    if inside_s:
        result["cuda_restore_until_restored_s"] = _stats(inside_s)
    result["cuda_restore_tier"] = ",".join(sorted(tiers)) or None
    result["cuda_restore_identical"] = identical

    save_med = result["cuda_save_s"]["median"]
    pinned_med = result["baseline_pinned_copy_s"]["median"]
    pageable_med = result["baseline_pageable_copy_s"]["median"]
    result["cuda_save_bandwidth_gbps"] = nbytes / save_med / 1e9
    result["baseline_pinned_copy_bandwidth_gbps"] = nbytes / pinned_med / 1e9
    result["baseline_pageable_copy_bandwidth_gbps"] = nbytes / pageable_med / 1e9
    result["cuda_restore_bandwidth_gbps"] = nbytes / result["cuda_restore_s"]["median"] / 1e9
    result["ratio_cuda_save_vs_pinned_copy"] = save_med / pinned_med
    result["ratio_cuda_save_vs_pageable_copy"] = save_med / pageable_med
    result["ratio_cuda_save_vs_torch_save"] = save_med / result["baseline_torch_save_s"]["median"]
    result["ratio_cuda_save_nonblocking_vs_pinned_copy"] = (
        result["cuda_save_nonblocking_s"]["median"] / pinned_med
    )
    result["ratio_cuda_save_nonblocking_complete_vs_pinned_copy"] = (
        result["cuda_save_nonblocking_complete_s"]["median"] / pinned_med
    )
    return result


def bench_cuda(
    sizes: list[int], repeats: int, disk_dir: Path, shm_dir: Path
) -> dict[str, Any] | str:
    """Every size's CUDA figures; a string saying why when there are none."""
    if not torch.cuda.is_available():
        return NO_CUDA
    if not sizes:
        return "not requested (--cuda-sizes is empty)"
    results: dict[str, Any] = {}
    for mib in sizes:
        try:
            results[f"{mib}MiB"] = bench_cuda_size(mib, repeats, disk_dir, shm_dir)
        except Exception as exc:  # keep the other figures; the error is in the results
            traceback.print_exc()
            results[f"{mib}MiB"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            shutil.rmtree(shm_dir / f"cuda-{mib}", ignore_errors=True)
            gc.collect()
            torch.cuda.empty_cache()
            _empty_host_cache()
    return results


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _mbs(text: str) -> list[float]:
    return [float(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="MiB of state, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--spaced-size", type=int, default=256, help="MiB of state for the spaced saves"
    )
    parser.add_argument("--spaced-saves", type=int, default=8, help="saves in the spaced run")
    parser.add_argument(
        "--spacing",
        type=float,
        default=0.5,
        help="seconds idle before each spaced save and each spaced copy",
    )
    parser.add_argument(
        "--cuda-sizes", default="1024,4096", help="MiB of CUDA state, comma-separated"
    )
    parser.add_argument(
        "--per-call-sizes", default="1.4,16", help="MB of the many-tensor states, comma-separated"
    )
    parser.add_argument(
        "--per-call-tensors", type=int, default=116, help="tensors in each many-tensor state"
    )
    parser.add_argument(
        "--per-call-repeats", type=int, default=20, help="saves timed per many-tensor state"
    )
    parser.add_argument("--only-per-call", action="store_true", help="only the per-call figures")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    sizes = _sizes(args.sizes)
    results: dict[str, Any] = {}
    disk_dir = Path(tempfile.mkdtemp(prefix="tg-bench-", dir=os.environ.get("TMPDIR", "/var/tmp")))
    shm_dir = Path(tempfile.mkdtemp(prefix="tg-bench-", dir="/dev/shm"))
    try:
        results["per_call"] = {
            f"{mb:g}MB": bench_per_call(mb, args.per_call_tensors, args.per_call_repeats, shm_dir)
            for mb in _mbs(args.per_call_sizes)
        }
        if not args.only_per_call:
            for mib in sizes:
                results[f"{mib}MiB"] = bench_size(mib, args.repeats, disk_dir, shm_dir)
            results["spaced"] = bench_spaced(
                args.spaced_size, args.spaced_saves, args.spacing, shm_dir
            )
            results["cuda"] = bench_cuda(_sizes(args.cuda_sizes), args.repeats, disk_dir, shm_dir)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
