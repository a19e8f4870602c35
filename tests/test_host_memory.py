"""Faulting in host memory ahead of data (checkpoint/host_memory.py)."""

from __future__ import annotations

import os

import torch

from trainguard.checkpoint import host_memory
from trainguard.checkpoint.host_memory import PREFAULT_STEP, Prefault


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_steps_take_each_stream_in_pieces_in_order() -> None:
    assert host_memory._steps([(1000, PREFAULT_STEP + 5), (9, 3)]) == [
        (1000, PREFAULT_STEP),
        (1000 + PREFAULT_STEP, 5),
        (9, 3),
    ]


def test_fresh_memory_is_faulted_in_and_written_memory_is_left_as_it_was() -> None:
    nbytes = 96 << 20
    fresh = torch.empty(nbytes, dtype=torch.uint8)  # never touched: not resident yet
    written = torch.arange(1 << 20, dtype=torch.int64)
    before = _resident_bytes()
    streams = [
        [(fresh.data_ptr(), nbytes // 2)],
        [(fresh.data_ptr() + nbytes // 2, nbytes // 2), (written.data_ptr(), 8 << 20)],
    ]
    with Prefault(streams) as prefault:
        prefault._thread.join(120)
    assert _resident_bytes() - before >= nbytes * 0.9
    assert torch.equal(written, torch.arange(1 << 20, dtype=torch.int64))
