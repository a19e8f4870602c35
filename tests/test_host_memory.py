"""Faulting in host memory ahead of data (checkpoint/host_memory.py)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
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


def test_populate_with_a_pause_faults_in_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot's background fault-in calls ``pause`` before each chunk (a save's copy
    holds it there) and still faults in every byte, from an unaligned start too."""
    page = os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(host_memory, "POPULATE_CHUNK", 256 * page)
    nbytes = 1000 * page
    fresh = mmap.mmap(-1, nbytes + page)  # a new anonymous mapping: nothing resident yet
    address = ctypes.addressof(ctypes.c_char.from_buffer(fresh))
    pauses: list[int] = []
    before = _resident_bytes()
    assert host_memory.populate(address + 100, nbytes, lambda: pauses.append(1))
    assert len(pauses) == 4  # ceil(1000 / 256) chunks (the 100 bytes stay in the first page)
    assert _resident_bytes() - before >= nbytes * 0.9
