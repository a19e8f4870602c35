"""The log layout, the console and the tailer, in process (the test writes the worker files)."""

from __future__ import annotations

import io
import select
import time
from collections.abc import Callable
from pathlib import Path

from trainguard.agent.logs import Console, LogLayout, LogTailer
from trainguard.monitor.lines import split_lines
from trainguard.monitor.progress import ProgressMatcher
from trainguard.monitor.rules import LogRuleSpec, NodeLogMonitor

INTERVAL = 0.02


class RecordingStream(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return super().write(data)


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_layout_paths(tmp_path: Path) -> None:
    layout = LogLayout(tmp_path)
    assert layout.stdout(2, 5) == tmp_path / "attempt-2" / "rank-5" / "stdout.log"
    assert layout.stderr(2, 5) == tmp_path / "attempt-2" / "rank-5" / "stderr.log"
    assert layout.error_file(2, 5) == tmp_path / "attempt-2" / "rank-5" / "error.json"
    assert layout.combined(5) == tmp_path / "rank-5.log"


def test_console_writes_each_prefixed_line_in_one_write() -> None:
    stream = RecordingStream()
    Console(stream).write_line(3, b"loss 0.5")
    assert stream.writes == [b"[rank3]: loss 0.5\n"]


def test_console_prefixes_a_line_torch_already_prefixed_once() -> None:
    """torch.distributed's excepthook writes ``[rank0]: Traceback...``: printed with one
    prefix, not ``[rank0]: [rank0]:`` (friction: every traceback line read so)."""
    stream = RecordingStream()
    console = Console(stream)
    console.write_line(0, b"[rank0]: Traceback (most recent call last):")
    console.write_line(0, b"[rank1]: a line about another rank")
    console.write_line(0, b"")
    assert stream.writes == [
        b"[rank0]: Traceback (most recent call last):\n",
        b"[rank0]: [rank1]: a line about another rank\n",
        b"[rank0]: \n",
    ]


def test_console_survives_a_closed_stream() -> None:
    stream = RecordingStream()
    stream.close()
    Console(stream).write_line(0, b"lost")  # no exception


def make_tailer(
    tmp_path: Path, attempt: int, lines: list[tuple[int, str, str]], console: Console | None = None
) -> tuple[LogLayout, LogTailer]:
    layout = LogLayout(tmp_path)
    for rank in (4, 5):
        layout.rank_dir(attempt, rank).mkdir(parents=True, exist_ok=True)
    tailer = LogTailer(
        layout,
        attempt,
        {0: 4, 1: 5},
        interval=INTERVAL,
        console=console,
        on_lines=lambda rank, stream, block, t: lines.extend(
            (rank, stream, line.decode()) for line in split_lines(block)
        ),
    )
    return layout, tailer


def test_tailer_holds_partial_lines_until_the_newline_or_the_exit(tmp_path: Path) -> None:
    lines: list[tuple[int, str, str]] = []
    stream = RecordingStream()
    layout, tailer = make_tailer(tmp_path, 0, lines, Console(stream))
    out = layout.stdout(0, 4).open("wb", buffering=0)
    tailer.start()

    out.write(b"step 1\nstep 2 lo")
    eventually(lambda: (4, "stdout", "step 1") in lines)
    time.sleep(5 * INTERVAL)
    assert lines == [(4, "stdout", "step 1")]  # the partial line is held

    out.write(b"ss 0.1\nno newline")
    eventually(lambda: len(lines) == 2)
    assert lines[1] == (4, "stdout", "step 2 loss 0.1")

    tailer.finish_rank(0)  # the worker exited: its partial line is a line
    eventually(lambda: len(lines) == 3)
    assert lines[2] == (4, "stdout", "no newline")
    assert tailer.stop(timeout=10)

    assert layout.combined(4).read_bytes() == (
        b"=== trainguard: attempt 0 ===\nstep 1\nstep 2 loss 0.1\nno newline\n"
    )
    assert b"".join(stream.writes) == (
        b"[rank4]: step 1\n[rank4]: step 2 loss 0.1\n[rank4]: no newline\n"
    )


def test_stop_drains_everything_and_the_combined_log_spans_attempts(tmp_path: Path) -> None:
    lines: list[tuple[int, str, str]] = []
    layout, first = make_tailer(tmp_path, 0, lines)
    first.start()
    layout.stdout(0, 5).write_bytes(b"a\nb")
    layout.stderr(0, 5).write_bytes(b"oops\n")
    assert first.stop(timeout=10)  # written just before stop: nothing is lost
    assert sorted(lines) == [(5, "stderr", "oops"), (5, "stdout", "a"), (5, "stdout", "b")]

    _, second = make_tailer(tmp_path, 1, lines)
    second.start()
    layout.stdout(1, 5).write_bytes(b"again\n")
    assert second.stop(timeout=10)
    combined = layout.combined(5).read_text().splitlines()
    assert combined[0] == "=== trainguard: attempt 0 ==="
    assert combined.index("=== trainguard: attempt 1 ===") == 4
    assert combined[-1] == "again"
    assert layout.combined(4).read_text().splitlines() == [
        "=== trainguard: attempt 0 ===",
        "=== trainguard: attempt 1 ===",
    ]


def test_a_failing_hook_does_not_stop_the_tailer(tmp_path: Path) -> None:
    layout = LogLayout(tmp_path)
    layout.rank_dir(0, 0).mkdir(parents=True)
    stream = RecordingStream()

    def bad_hook(rank: int, name: str, block: bytes, t: float) -> None:
        raise RuntimeError("monitor bug")

    tailer = LogTailer(
        layout, 0, {0: 0}, interval=INTERVAL, console=Console(stream), on_lines=bad_hook
    )
    tailer.start()
    layout.stdout(0, 0).write_bytes(b"one\ntwo\n")
    assert tailer.stop(timeout=10)
    assert b"".join(stream.writes) == b"[rank0]: one\n[rank0]: two\n"


def test_relabelled_ranks_log_their_next_lines_as_the_new_ranks(tmp_path: Path) -> None:
    # An elastic scaling in place renumbered this node's workers (ranks 4, 5 -> 2, 3).
    lines: list[tuple[int, str, str]] = []
    layout, tailer = make_tailer(tmp_path, 0, lines)
    tailer.start()
    out = layout.stdout(0, 5)
    out.write_bytes(b"before\n")
    eventually(lambda: (5, "stdout", "before") in lines)
    tailer.relabel({0: 2, 1: 3})
    with out.open("ab") as f:
        f.write(b"after\n")
    assert tailer.stop(timeout=10)
    assert lines == [(5, "stdout", "before"), (3, "stdout", "after")]
    assert layout.combined(3).read_text().splitlines() == ["after"]


def test_a_burst_is_one_console_write_and_a_rule_still_fires_on_its_middle_line(
    tmp_path: Path,
) -> None:
    """A worker's burst of lines is read in chunks: the console gets whole prefixed lines in
    one write per chunk (not one per line), and every line still reaches the log rules: a
    NaN loss in the middle of 2000 lines is detected, and the progress is the last step."""
    rule = LogRuleSpec(name="loss", log_pattern=r".*Loss: ([^,]+),")
    monitor = NodeLogMonitor([rule], ProgressMatcher())
    stream = RecordingStream()
    layout = LogLayout(tmp_path)
    layout.rank_dir(0, 4).mkdir(parents=True)
    tailer = LogTailer(
        layout, 0, {0: 4}, interval=INTERVAL, console=Console(stream), on_lines=monitor.on_lines
    )
    burst = b"".join(
        b"Batch %d Loss: %s, Speed: 10.0 samples/sec\n" % (i, b"nan" if i == 1000 else b"0.5")
        for i in range(1, 2001)
    )
    layout.stdout(0, 4).write_bytes(burst)
    tailer.start()
    assert tailer.stop(timeout=10)

    shown = b"".join(stream.writes)
    assert shown.count(b"\n") == 2000 and shown.startswith(b"[rank4]: Batch 1 Loss: 0.5,")
    assert len(stream.writes) < 100  # chunks, not lines
    assert layout.combined(4).read_bytes().endswith(burst)
    snapshot = monitor.snapshot()
    assert [(d.kind, d.rank) for d in snapshot.detections] == [("NaNMetric", 4)]
    assert snapshot.detections[0].line.startswith("Batch 1000 Loss: nan")
    assert snapshot.rules["loss"].matches == 2000
    assert snapshot.progress is not None and snapshot.progress.step == 2000


def test_a_console_write_holds_whole_lines_and_at_most_pipe_buf_bytes() -> None:
    """Agents may share one pipe: a write of more than PIPE_BUF bytes could interleave with
    another's mid-line, so a burst goes out in whole-line writes of at most PIPE_BUF (a
    longer line alone)."""
    stream = RecordingStream()
    lines = [b"x" * 100] * 300 + [b"y" * 10_000, b"z"]
    Console(stream).write_lines(2, b"".join(line + b"\n" for line in lines))
    assert b"".join(stream.writes) == b"".join(b"[rank2]: " + line + b"\n" for line in lines)
    assert all(w.endswith(b"\n") for w in stream.writes)
    assert all(len(w) <= select.PIPE_BUF for w in stream.writes if b"y" not in w)
    assert 1 < len(stream.writes) < 20


def test_a_line_cut_between_two_reads_is_judged_whole(tmp_path: Path) -> None:
    """A worker's line arrives in two writes, read in two passes: the rules see it once,
    whole (a NaN in its second half is found, the line is the evidence)."""
    rule = LogRuleSpec(name="loss", log_pattern=r".*Loss: ([^,]+),")
    monitor = NodeLogMonitor([rule], ProgressMatcher())
    layout = LogLayout(tmp_path)
    layout.rank_dir(0, 4).mkdir(parents=True)
    out = layout.stdout(0, 4).open("wb", buffering=0)
    tailer = LogTailer(layout, 0, {0: 4}, interval=INTERVAL, on_lines=monitor.on_lines)
    tailer.start()
    out.write(b"Batch 7 Loss: 0.5, ok\nBatch 8 Loss: n")
    eventually(lambda: monitor.snapshot().rules["loss"].matches == 1)
    time.sleep(5 * INTERVAL)  # passes that find only the partial line
    out.write(b"an, Speed: 1.0 samples/sec\n")
    assert tailer.stop(timeout=10)
    snapshot = monitor.snapshot()
    assert snapshot.rules["loss"].matches == 2
    assert [(d.kind, d.line) for d in snapshot.detections] == [
        ("NaNMetric", "Batch 8 Loss: nan, Speed: 1.0 samples/sec")
    ]
    assert snapshot.progress is not None and snapshot.progress.step == 8


def test_lines_read_a_pass_later_keep_the_time_they_were_written(tmp_path: Path) -> None:
    """Between passes the tailer waits (``interval``) while a worker writes on: what it
    then reads is timed when it was written (its file's modification time), not when it
    was read, so the pace of the passes does not move a hang timer or a step's time."""
    got: list[tuple[bytes, float, float]] = []  # block, its time, when it was handed over
    layout = LogLayout(tmp_path)
    layout.rank_dir(0, 0).mkdir(parents=True)
    out = layout.stdout(0, 0).open("wb", buffering=0)
    tailer = LogTailer(
        layout, 0, {0: 0}, interval=1.0,
        on_lines=lambda rank, stream, block, t: got.append((block, t, time.time())),
    )  # fmt: skip
    tailer.start()
    out.write(b"first\n")  # after a quiet spell: read at once
    eventually(lambda: len(got) == 1)
    out.write(b"second\n")  # read by the next pass, up to a second later
    written = time.time()
    eventually(lambda: len(got) == 2)
    assert tailer.stop(timeout=10)
    block, t, handed = got[1]
    assert block == b"second\n"
    assert t <= written + 0.05  # the file's clock may lag time.time() by a tick
    assert handed - t > 0.5
