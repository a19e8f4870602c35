"""``trainguard run``'s live line: its text (pure), its drawing, and a real run in tmux."""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from conftest import REPO, Trainguard
from trainguard.control.events import Event
from trainguard.observe.live import (
    ERASE,
    LastFault,
    LiveLine,
    LiveView,
    StepSeen,
    live_text,
    live_wanted,
    steps_per_second,
)
from trainguard.wire.status import Progress

NOW = 1_000_000.0
LIVE = re.compile(r"trainguard │ step (\d+)(?:/(\d+))? │ \S+ steps/s │ ETA (\S+) │ restarts \d+")
# A worker that says its total, the way training loops often do ("Step 41/1000").
TOTAL_WORKER = """\
import sys, time
total = int(sys.argv[1])
for step in range(1, total + 1):
    time.sleep(0.01)
    print(f"Step {step}/{total} loss 0.5", flush=True)
"""


# -- the text -------------------------------------------------------------------------


def test_no_progress_yet() -> None:
    assert live_text(LiveView(NOW)) == (
        "trainguard │ step - │ - steps/s │ ETA - │ restarts 0 │ no faults"
    )


def test_unknown_total_has_no_eta() -> None:
    text = live_text(LiveView(NOW, step=41, rate=12.34, restarts=2))
    assert text == "trainguard │ step 41 │ 12.3 steps/s │ ETA - │ restarts 2 │ no faults"


def test_known_total_gives_an_eta() -> None:
    text = live_text(LiveView(NOW, step=41, total=1000, rate=12.3))
    # (1000 - 41) / 12.3 = 78 s
    assert text.startswith("trainguard │ step 41/1000 │ 12.3 steps/s │ ETA 1m18s │ restarts 0")


def test_eta_needs_a_rate() -> None:
    assert "ETA -" in live_text(LiveView(NOW, step=41, total=1000, rate=None))
    assert "│ 0.0 steps/s │ ETA - │" in live_text(LiveView(NOW, step=41, total=1000, rate=0.0))
    assert "ETA -" in live_text(LiveView(NOW, step=None, total=1000, rate=3.0))


def test_long_etas_and_rates() -> None:
    assert "ETA 2h46m" in live_text(LiveView(NOW, step=0, total=10_000, rate=1.0))
    assert "ETA 5d18h" in live_text(LiveView(NOW, step=0, total=500_000, rate=1.0))
    assert "│ 2500 steps/s │" in live_text(LiveView(NOW, step=1, rate=2500.4))
    assert "│ 0.025 steps/s │" in live_text(LiveView(NOW, step=1, rate=0.025))


def test_last_fault_with_rank_node_and_age() -> None:
    fault = LastFault("WorkerCrash", NOW - 12.2, rank=3, node="node-1")
    text = live_text(LiveView(NOW, step=41, rate=5.0, restarts=1, last_fault=fault))
    assert text.endswith("│ restarts 1 │ last fault WorkerCrash rank 3 (node-1) 12s ago")


def test_last_fault_of_a_node_or_of_the_job() -> None:
    lost = LastFault("NodeLost", NOW - 125, node="node-0")
    assert live_text(LiveView(NOW, last_fault=lost)).endswith(
        "last fault NodeLost node-0 2m05s ago"
    )
    late = LastFault("DeadlineExceeded", NOW + 1)  # a clock step back: never negative
    assert live_text(LiveView(NOW, last_fault=late)).endswith("last fault DeadlineExceeded 0s ago")


def test_rate_over_the_samples() -> None:
    assert steps_per_second([], NOW) is None
    assert steps_per_second([StepSeen(NOW, 5)], NOW) is None
    samples = [StepSeen(NOW - 10, 0), StepSeen(NOW - 5, 20), StepSeen(NOW - 1, 45)]
    assert steps_per_second(samples, NOW) == pytest.approx(5.0)
    # No new step for longer than the stall time: 0 (a hang shows as one).
    assert steps_per_second(samples, NOW + 30, stall=10) == 0.0
    assert steps_per_second([StepSeen(NOW, 9), StepSeen(NOW, 9)], NOW) is None


def test_live_wanted_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not live_wanted(io.StringIO())
    main, other = os.openpty()
    with open(other, "w") as tty:
        monkeypatch.setenv("TERM", "xterm")
        assert live_wanted(tty)
        monkeypatch.setenv("TERM", "dumb")
        assert not live_wanted(tty)
    os.close(main)


# -- the drawing ----------------------------------------------------------------------


def _controller(attempt: int, progress: Progress | None, restarts: int = 0) -> Any:
    current = SimpleNamespace(number=attempt, watch=SimpleNamespace(progress=progress))
    return cast(Any, SimpleNamespace(current=current, restarts=restarts))


def test_lines_go_above_the_live_line_unchanged() -> None:
    out, err = io.StringIO(), io.StringIO()
    live = LiveLine(out, width=200)
    live.above(out, "[rank0]: before any turn\n")
    assert out.getvalue() == "[rank0]: before any turn\n"  # nothing drawn yet: as it is
    live.above(out, "[rank0]: Step 3/40 loss 1\n")  # the total comes from the lines
    live.update(
        _controller(0, Progress(first_step=1, first_time=NOW, step=3, time=NOW + 1)), [], NOW
    )
    drawn = out.getvalue().rsplit("\n", 1)[1]
    assert drawn.startswith(ERASE)
    assert "step 3/40 │ 2.0 steps/s │ ETA 19s │ restarts 0 │ no faults" in drawn
    out.truncate(0)
    out.seek(0)
    live.above(out, "[rank1]: a rank's line\n")
    assert out.getvalue() == ERASE + "[rank1]: a rank's line\n" + drawn.removeprefix(ERASE)
    out.truncate(0)
    out.seek(0)
    live.above(err, "[trainguard] an event\n")  # on the other stream: erased, then redrawn
    assert err.getvalue() == "[trainguard] an event\n"
    assert out.getvalue() == ERASE + drawn.removeprefix(ERASE)
    live.close()
    assert out.getvalue().endswith(ERASE)
    out.truncate(0)
    out.seek(0)
    live.above(out, "[trainguard] after the run\n")
    assert out.getvalue() == "[trainguard] after the run\n"


def test_a_fault_event_shows_at_once() -> None:
    out = io.StringIO()
    live = LiveLine(out, width=200)
    progress = Progress(first_step=0, first_time=NOW, step=10, time=NOW + 1)
    live.update(_controller(0, progress), [], NOW + 1)
    fault = Event(NOW + 1.05, "Fault", "rank 1 exited", 0, "node-0", 1, {"type": "WorkerCrash"})
    live.update(_controller(1, None, restarts=1), [fault], NOW + 1.1)  # within the redraw wait
    last = out.getvalue().rsplit(ERASE, 1)[1]
    assert (
        "step 10 │ - steps/s │ ETA - │ restarts 1 │ last fault WorkerCrash rank 1 (node-0) 0s ago"
        in last
    )


def test_a_terminal_without_box_drawing_gets_ascii() -> None:
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="latin-1")
    live = LiveLine(out, width=30)
    live.update(_controller(0, None), [], NOW)
    assert raw.getvalue() == (ERASE + "trainguard | step - | - steps").encode()  # 29 columns


def test_a_broken_terminal_turns_the_line_off() -> None:
    out = io.StringIO()
    live = LiveLine(out, width=100)
    out.close()
    live.update(_controller(0, None), [], NOW)  # no exception: the job goes on
    live.above(io.StringIO(), "a line\n")


# -- a real run -----------------------------------------------------------------------


def _tmux(sock: Path, *args: str) -> str:
    done = subprocess.run(
        ["tmux", "-S", str(sock), *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_line_in_a_terminal_and_not_in_a_pipe(tg: Trainguard, tmp_path: Path) -> None:
    worker = tmp_path / "total_worker.py"
    worker.write_text(TOTAL_WORKER)
    run = ["run", "--nnodes", "1", "--nproc-per-node", "2", str(worker)]
    env = {"TRAINGUARD_STATE_DIR": str(tg.state_dir / "tty"), "PYTHONUNBUFFERED": "1"}
    command = " ".join(
        [
            "env",
            *(f"{k}={shlex.quote(v)}" for k, v in env.items()),
            shlex.join([sys.executable, "-m", "trainguard.cli", *run, "1000"]),
            "; echo RUN-EXITED-$?; sleep 600",
        ]
    )
    sock, conf = tmp_path / "tmux.sock", tmp_path / "tmux.conf"
    conf.write_text("set -g history-limit 50000\n")
    try:
        _tmux(
            sock,
            "-f",
            str(conf),
            "new-session",
            "-d",
            "-x",
            "200",
            "-y",
            "40",
            "-c",
            str(REPO),
            command,
        )
        screen, deadline = "", time.monotonic() + 180
        while time.monotonic() < deadline:
            screen = _tmux(sock, "capture-pane", "-p")
            lines = [line for line in screen.splitlines() if line.strip()]
            # The first steps have no rate yet (ETA -): the line gets one once they do.
            if lines and (m := LIVE.match(lines[-1])) and m.group(2) and m.group(3) != "-":
                break
            assert "RUN-EXITED" not in screen, f"the run ended before a live step:\n{screen}"
            time.sleep(0.2)
        else:
            raise AssertionError(f"no live line with a step, its total and an ETA:\n{screen}")
        step, total, _ = m.groups()
        assert total == "1000" and 0 <= int(step) <= 1000
        # The rank lines are above it as they are.
        assert re.search(r"^\[rank[01]\]: Step \d+/1000 loss 0\.5$", screen, re.M)
        deadline = time.monotonic() + 180
        while "RUN-EXITED" not in (screen := _tmux(sock, "capture-pane", "-p")):
            assert time.monotonic() < deadline, f"the run did not end:\n{screen}"
            time.sleep(0.5)
        assert "RUN-EXITED-0" in screen
        history = _tmux(sock, "capture-pane", "-p", "-S", "-")
        # Erased at the end; no rank line was cut by it.
        assert "steps/s" not in history
        rank_lines = [line for line in history.splitlines() if "[rank" in line]
        assert len(rank_lines) >= 2000
        assert all(re.fullmatch(r"\[rank[01]\]: Step \d+/1000 loss 0\.5", x) for x in rank_lines)
    finally:
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True, timeout=30)

    piped = tg.run(*run, "200")  # stdout and stderr are pipes
    assert piped.returncode == 0, piped.stderr
    assert "steps/s" not in piped.stdout + piped.stderr
    assert "\x1b" not in piped.stdout + piped.stderr and "\r" not in piped.stdout
    assert sorted(piped.stdout.splitlines()) == sorted(
        f"[rank{r}]: Step {s}/200 loss 0.5" for r in (0, 1) for s in range(1, 201)
    )
