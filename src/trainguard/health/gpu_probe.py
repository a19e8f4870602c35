"""``python -m trainguard.health.gpu_probe``: the CUDA side of the ``gpu`` check.

Run in a child process by `trainguard.health.gpu.GpuCheck` (the agent does not import
torch). Prints one JSON object on stdout and judges nothing:

- ``{"torch": false, "error": ...}`` where torch cannot be imported;
- ``{"torch": true, "cuda": false, "device_count": 0}`` where no CUDA device is visible;
- else ``device_count`` and, unless ``--count-only``, one entry per device: a float32
  matmul compared with the CPU's result (``matmul_error``: the largest difference
  relative to the largest value), its speed (``tflops``), and a memory pattern test
  (``pattern_ok``: 0xA5, 0x5A and an index pattern over ``--pattern-mib`` MiB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

_MIB: Final = 1024 * 1024
_TIMED_MATMULS: Final = 10


def probe(count_only: bool, matmul_size: int, pattern_mib: int) -> dict[str, Any]:
    """What this machine's CUDA devices do (see the module's docstring)."""
    try:
        import torch
    except ImportError as exc:
        return {"torch": False, "error": str(exc)}
    if not torch.cuda.is_available():
        return {"torch": True, "cuda": False, "device_count": 0}
    count = int(torch.cuda.device_count())
    answer: dict[str, Any] = {"torch": True, "cuda": True, "device_count": count}
    if not count_only:
        answer["devices"] = [_tested(torch, i, matmul_size, pattern_mib) for i in range(count)]
    return answer


def _tested(torch: Any, index: int, size: int, pattern_mib: int) -> dict[str, Any]:
    try:
        return _device(torch, index, size, pattern_mib)
    except Exception as exc:  # a CUDA error on one device is that device's result
        return {"index": index, "error": f"{type(exc).__name__}: {exc}"}


def _device(torch: Any, index: int, size: int, pattern_mib: int) -> dict[str, Any]:
    device = torch.device("cuda", index)
    entry: dict[str, Any] = {"index": index, "name": str(torch.cuda.get_device_name(index))}
    generator = torch.Generator().manual_seed(index)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    expected = a @ b
    torch.backends.cuda.matmul.allow_tf32 = False
    on_gpu_a, on_gpu_b = a.to(device), b.to(device)
    got = (on_gpu_a @ on_gpu_b).cpu()
    scale = float(expected.abs().max()) or 1.0
    entry["matmul_error"] = float((got - expected).abs().max()) / scale
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(_TIMED_MATMULS):
        on_gpu_a @ on_gpu_b
    torch.cuda.synchronize(device)
    elapsed = max(time.perf_counter() - start, 1e-9)
    entry["tflops"] = round(_TIMED_MATMULS * 2 * size**3 / elapsed / 1e12, 2)
    del on_gpu_a, on_gpu_b
    entry["pattern_ok"] = _pattern_ok(torch, device, pattern_mib)
    torch.cuda.empty_cache()
    return entry


def _pattern_ok(torch: Any, device: Any, mib: int) -> bool:
    numel = mib * _MIB
    for value in (0xA5, 0x5A):
        filled = torch.full((numel,), value, dtype=torch.uint8, device=device)
        if not bool((filled == value).all()):
            return False
        del filled
    count = numel // 4
    index = torch.arange(count, dtype=torch.int32, device=device)
    total = int(index.sum(dtype=torch.int64))
    return total == count * (count - 1) // 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.health.gpu_probe")
    parser.add_argument("--count-only", action="store_true")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--pattern-mib", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        answer = probe(args.count_only, args.matmul_size, args.pattern_mib)
    except Exception as exc:  # the answer says what broke
        answer = {"torch": True, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
