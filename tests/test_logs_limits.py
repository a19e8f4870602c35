"""Logs cannot fill a disk or flood a terminal: rotation, the workers' spools, the
terminal's share of the lines, and a 40 MB flood through ``trainguard run``."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import Trainguard
from trainguard.agent import spool as spool_module
from trainguard.agent.logcap import RotatingFile, copy_truncate
from trainguard.agent.logs import LogLayout, LogTailer
from trainguard.platform.console import Console
from trainguard.platform.throttle import LineThrottle
from trainguard.wire.logs import LogLimits

MIB = 1024 * 1024
INTERVAL = 0.02


def eventually(check: object, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def family(path: Path) -> list[Path]:
    """``path`` and its rotations that exist, newest last."""
    rotations = sorted(
        path.parent.glob(f"{path.name}.*"), key=lambda p: -int(p.name.rsplit(".", 1)[1])
    )
    return [*rotations, *([path] if path.exists() else [])]


def disk_bytes(root: Path) -> int:
    """What the files under ``root`` take on disk (allocated blocks, holes excluded)."""
    total = 0
    for path in root.rglob("*"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue  # rotated away meanwhile
        if path.is_file():
            total += min(st.st_size, st.st_blocks * 512)
    return total


# --- rotation of files the agent writes ------------------------------------------------------


def test_rotating_file_keeps_the_newest_files_within_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    log = RotatingFile(path, LogLimits(max_bytes_per_rank=MIB, keep=2))
    lines = [b"%08d %s\n" % (i, b"x" * 1000) for i in range(5000)]  # about 5 MB
    for line in lines:
        log.write(line)
    log.close()
    files = family(path)
    assert [p.name for p in files] == ["rank-0.log.2", "rank-0.log.1", "rank-0.log"]
    assert all(p.stat().st_size <= MIB for p in files)
    kept = b"".join(p.read_bytes() for p in files)
    assert lines[-1] in kept and kept.endswith(lines[-1])  # the newest, in order
    assert b"".join(lines).endswith(kept)  # nothing lost within what is kept


def test_rotating_file_counts_what_was_there_and_keep_zero_keeps_none(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    path.write_bytes(b"y" * (MIB - 10))
    log = RotatingFile(path, LogLimits(max_bytes_per_rank=MIB, keep=0))
    log.write(b"z" * 20)  # would pass the cap: a new file first
    log.close()
    assert family(path) == [path] and path.read_bytes() == b"z" * 20


def test_copy_truncate_rotates_a_file_another_process_appends_to(tmp_path: Path) -> None:
    path = tmp_path / "agent.log"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"old\n")
        copy_truncate(path, keep=1)
        os.write(fd, b"new\n")  # O_APPEND: at the new end, offset 0, no hole
    finally:
        os.close(fd)
    assert (tmp_path / "agent.log.1").read_bytes() == b"old\n"
    assert path.read_bytes() == b"new\n"


AGENT_LOGGING = """\
import logging, os, sys
from trainguard.agent.logcap import CappedStderrHandler
from trainguard.wire.logs import LogLimits
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.dup2(fd, 2)
limits = LogLimits(max_bytes_per_rank=1024 * 1024, keep=1)
logging.basicConfig(level="INFO", handlers=[CappedStderrHandler(limits)])
for i in range(30_000):
    logging.getLogger("agent").info("record %d %s", i, "r" * 100)
"""


def test_the_agents_own_log_is_capped(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    subprocess.run([sys.executable, "-c", AGENT_LOGGING, str(log)], check=True, timeout=120)
    files = family(log)
    assert [p.name for p in files] == ["node-0.log.1", "node-0.log"]
    assert all(p.stat().st_size <= MIB + 200 for p in files)
    assert b"record 29999 " in log.read_bytes()  # the newest record is in the live file


# --- the workers' spools -------------------------------------------------------------------------


def tailer_for(tmp_path: Path, limits: LogLimits, **kwargs: int) -> tuple[LogLayout, LogTailer]:
    layout = LogLayout(tmp_path / "logs")
    layout.rank_dir(0, 0).mkdir(parents=True)
    layout.stdout(0, 0).touch()
    tailer = LogTailer(layout, 0, {0: 0}, interval=INTERVAL, limits=limits, **kwargs)
    return layout, tailer


def append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def allocated(path: Path) -> int:
    """Disk bytes of one file (a punched hole takes none)."""
    st = path.stat()
    return min(st.st_size, st.st_blocks * 512)


@pytest.fixture(params=["punch", "truncate"])
def spool_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a spool gives its read part back: punching holes, or (on a filesystem
    that cannot) truncating once caught up."""
    if request.param == "truncate":
        monkeypatch.setattr(spool_module, "_FALLOCATE", None)
    elif not spool_module.punch_hole(os.open(os.devnull, os.O_RDONLY), 0):
        pytest.skip("no fallocate here")
    return str(request.param)


def test_a_caught_up_spool_gives_its_space_back_and_loses_nothing(
    tmp_path: Path, spool_mode: str
) -> None:
    layout, tailer = tailer_for(tmp_path, LogLimits(max_bytes_per_rank=MIB, keep=100))
    spool, combined = layout.stdout(0, 0), layout.combined(0)
    tailer.start()
    try:
        first = b"".join(b"first %06d %s\n" % (i, b"a" * 200) for i in range(1000))  # 210 KB
        append(spool, first)  # past MIB/8: given back once read
        eventually(lambda: allocated(spool) < 8192)
        # Punched: the same length, a hole where the read part was; truncated: empty.
        assert spool.stat().st_size == (len(first) if spool_mode == "punch" else 0)
        append(spool, b"second\n")
        eventually(lambda: b"second\n" in combined.read_bytes())
    finally:
        assert tailer.stop(timeout=10)
    assert combined.read_bytes() == b"=== trainguard: attempt 0 ===\n" + first + b"second\n"
    assert spool.stat().st_size == len(first) + 7 if spool_mode == "punch" else 7


def test_a_writer_far_ahead_has_its_backlog_skipped_but_the_newest_lines(
    tmp_path: Path, spool_mode: str
) -> None:
    # 64 KiB lines and a 256 KiB read budget per pass; 1 MiB unread is past MIB/4.
    layout, tailer = tailer_for(
        tmp_path, LogLimits(max_bytes_per_rank=MIB, keep=1), max_line_bytes=64 * 1024
    )
    spool, combined = layout.stdout(0, 0), layout.combined(0)
    append(spool, b"b" * 1000 + b"\n")
    append(spool, b"".join(b"c%06d %s\n" % (i, b"c" * 1015) for i in range(1024)))
    append(spool, b"Traceback: the last words\n")
    tailer.start()
    try:
        eventually(lambda: b"the last words" in combined.read_bytes())
        append(spool, b"after\n")
        eventually(lambda: b"after\n" in combined.read_bytes())
    finally:
        assert tailer.stop(timeout=10)
    text = combined.read_bytes()
    assert b"bytes of rank 0's stdout not kept: written faster than the agent reads" in text
    before, after = text.split(b" not kept: ")
    kept = [line for line in after.splitlines() if line.startswith(b"c")]
    assert kept[-1].startswith(b"c001023 ")  # the newest lines are kept
    assert all(len(line) == 1023 for line in kept)  # whole lines, from a line's start
    read = [line for line in before.splitlines() if line.startswith(b"c")]
    assert len(read) + len(kept) < 1024 // 2  # most of the backlog was skipped
    numbers = [int(line[1:7]) for line in read[:-1] + kept]  # (the last one read is cut)
    assert numbers == sorted(numbers)
    assert allocated(spool) < MIB // 4


def test_a_40mb_flood_from_a_real_process_stays_within_the_cap(tmp_path: Path) -> None:
    cap, keep = 4 * MIB, 2
    layout, tailer = tailer_for(tmp_path, LogLimits(max_bytes_per_rank=cap, keep=keep))
    spool = layout.stdout(0, 0)
    flood = (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
        "line = b'flood ' + b'x' * 1017 + b'\\n'\n"
        "for _ in range(40 * 1024):\n"  # 40 MiB
        "    os.write(fd, line)\n"
        "os.write(fd, b'FLOOD DONE\\n')\n"
    )
    peak = 0
    tailer.start()
    try:
        writer = subprocess.Popen([sys.executable, "-c", flood, str(spool)])
        while writer.poll() is None:
            peak = max(peak, disk_bytes(layout.root))
            time.sleep(0.005)
        assert writer.returncode == 0
        combined = layout.combined(0)
        eventually(lambda: b"FLOOD DONE" in combined.read_bytes())  # the tail still works
        peak = max(peak, disk_bytes(layout.root))
    finally:
        tailer.stop(timeout=30)
    # rank-0.log and its rotations: cap x (keep + 1); the spool: at most one cap more,
    # plus what the writer adds between two looks of the tailer: some ms of a flood, more
    # on a loaded 2-core CI machine (seen: 30 KB over a 2 MiB slack). Far under 40 MB.
    assert peak <= cap * (keep + 2) + 6 * MIB, peak
    files = family(layout.combined(0))
    assert len(files) <= keep + 1 and all(p.stat().st_size <= cap for p in files)
    assert disk_bytes(layout.root) <= cap * (keep + 1) + 2 * MIB  # the spool: emptied


# --- the terminal's share -------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throttle_lets_a_burst_through_then_a_rate_and_counts_the_rest() -> None:
    clock = Clock()
    throttle = LineThrottle(rate=10, burst=5, note_every=2.0, clock=clock)
    assert [throttle.admit() for _ in range(8)] == [True] * 5 + [False] * 3
    assert throttle.note_due() == 0  # not yet: at most one note every 2 s
    clock.now = 1.0  # 10 more tokens, but the bucket holds 5
    assert [throttle.admit() for _ in range(7)] == [True] * 5 + [False] * 2
    clock.now = 2.0
    assert throttle.note_due() == 5
    assert throttle.note_due() == 0  # the count restarts after a note
    assert throttle.admit()  # the bucket refilled over the second
    assert throttle.note_due(final=True) == 0
    assert throttle.held_total == 5


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (1, 0)])
def test_throttle_refuses_bad_settings(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="bad throttle"):
        LineThrottle(rate=rate, burst=burst)


# --- end to end: trainguard run ---------------------------------------------------------------

FLOOD_WORKER = """\
import sys
line = "flood " + "x" * 93 + "\\n"
out = sys.stdout
for _ in range(400 * 1024):  # 40 MiB of 100-byte lines
    out.write(line)
out.write("FLOOD DONE\\n")
out.flush()
"""


def test_a_40mb_flood_through_trainguard_run(tg: Trainguard, tmp_path: Path) -> None:
    cap, keep = 4 * MIB, 2
    script = tmp_path / "flood.py"
    script.write_text(FLOOD_WORKER)
    job = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": "flood"},
        "spec": {
            "nprocPerNode": 1,
            "replicaSpecs": [
                {
                    "name": "pods",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "containers": [
                                {"name": "trainer", "command": [sys.executable, str(script)]}
                            ]
                        }
                    },
                }
            ],
            "trainguard": {"warmStart": False, "logs": {"maxBytesPerRank": cap, "keep": keep}},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    started = time.monotonic()
    run = tg.run("run", "-f", str(path), timeout=240)
    elapsed = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-3000:]
    job_id = tg.only_job()["id"]
    logs = tg.state_dir / "jobs" / job_id / "logs"
    # On disk: the rank's log and its rotations, console.log (all ranks, capped the same
    # way), the spool (emptied once the worker is gone), the agent's own log. (The bound
    # while it runs, at each look of the tailer, is the test above: here the worker may
    # flood before the agent's tailer is up.)
    assert disk_bytes(tg.state_dir / "jobs" / job_id) <= 2 * cap * (keep + 1) + 2 * MIB
    for name in ("rank-0.log", "console.log"):
        files = family(logs / name)
        assert len(files) <= keep + 1 and all(p.stat().st_size <= cap for p in files), files
    # The agent and its tail kept working: the last line is in the rank's log, and
    # `trainguard logs` shows the rotated files first.
    shown_logs = tg.run("logs", job_id, "--rank", "0").stdout
    assert "FLOOD DONE" in shown_logs
    kept = b"".join(p.read_bytes() for p in family(logs / "rank-0.log"))
    assert shown_logs == kept.decode()
    # The terminal got a share of the lines, and a count of the rest.
    shown = run.stdout.count("[rank0]: flood ")
    assert 0 < shown <= 1000 + 200 * elapsed + 10  # the burst, then the rate
    assert f"lines not shown; see trainguard logs {job_id}" in run.stderr


def test_the_console_pump_shows_the_terminals_share_of_a_block_and_logs_all(
    tmp_path: Path,
) -> None:
    """The runner copies an agent's console a block at a time: the terminal gets the
    throttle's share (the first lines), the rest is counted and said, console.log gets
    every line, and a last line without its newline is not lost."""
    out, err = io.StringIO(), io.StringIO()
    console = Console("job-1", out, err)
    console._terminal = LineThrottle(rate=1e-9, burst=3, note_every=0.0)
    with console.copied_to(tmp_path / "console.log", LogLimits()):
        console.pump(io.BytesIO(b"[rank0]: a\n[rank0]: b\n[rank0]: c\n[rank0]: d\n[rank0]: e"))
    assert out.getvalue() == "[rank0]: a\n[rank0]: b\n[rank0]: c\n"
    note = "[trainguard] 1 lines not shown; see trainguard logs job-1\n"
    assert err.getvalue() == note * 2  # one of the block, then the last line's
    assert (tmp_path / "console.log").read_bytes().endswith(b"[rank0]: d\n[rank0]: e")
    assert [LineThrottle(burst=5).admit_many(n) for n in (0, 2, 9)] == [0, 2, 5]
