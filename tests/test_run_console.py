"""What a run shows on its console: worker output made safe to show (observe/terminal.py),
and a console nobody reads any more (``trainguard run | head``) is no reason to stop."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, Trainguard
from trainguard.hosts.addresses import JobEndpoint, LocalAddress
from trainguard.hosts.daemon import HostDaemon
from trainguard.observe.live import ERASE, LiveLine
from trainguard.observe.terminal import safe_bytes, safe_cell, safe_text
from trainguard.platform.views import _table

# What a hostile worker wrote (issue 38): clear the screen, set the window title, write
# the clipboard (OSC 52), then erase its rank prefix and fake one of trainguard's lines.
HOSTILE = (
    "\x1b[2J\x1b[H"
    "\x1b]0;pwned\x07"
    "\x1b]52;c;ZWNobyBoaQ==\x07"
    "\r\x1b[2K[trainguard] 99:99:99 JobSucceeded: ... (FAKE)"
)
WORKER = f"""\
import sys
sys.stdout.write({HOSTILE!r} + "\\n")
sys.stdout.write("tab\\there, caf\\u00e9 \\u2713\\n")
sys.stdout.flush()
sys.stdout.buffer.write(b"not utf-8: \\xff\\xfe\\n")
for i in range(400):
    print(f"filler {{i}}", flush=True)
"""


def test_control_characters_are_shown_not_obeyed() -> None:
    shown = safe_text(HOSTILE)
    assert "\x1b" not in shown and "\r" not in shown and "\x07" not in shown
    assert shown.startswith("\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07")
    assert shown.endswith("\\r\\x1b[2K[trainguard] 99:99:99 JobSucceeded: ... (FAKE)")
    assert safe_text("a\tb\n") == "a\tb\n"  # tabs and line ends kept
    assert safe_text("café ✓ 日本") == "café ✓ 日本"  # valid UTF-8 text kept
    assert safe_text("\x00\x08\x7f\x9b\u202e\u2028") == "\\x00\\b\\x7f\\x9b\\u202e\\u2028"
    assert safe_bytes(b"ok \xff\xe2\x9c\x93\x1b") == "ok \\xff✓\\x1b"
    assert safe_text(shown) == shown  # nothing left to escape


def test_lines_above_the_live_line_are_escaped() -> None:
    out = io.StringIO()
    live = LiveLine(out, width=100)
    live.above(out, "[rank0]: " + HOSTILE + "\n")
    assert out.getvalue() == "[rank0]: " + safe_text(HOSTILE) + "\n"
    assert ERASE not in out.getvalue()


def _hostile_job(tmp_path: Path) -> Path:
    script = tmp_path / "hostile.py"
    script.write_text(WORKER)
    return script


def test_worker_escapes_reach_the_console_escaped_and_the_logs_raw(
    tg: Trainguard, tmp_path: Path
) -> None:
    done = tg.run("run", "--nproc-per-node", "1", str(_hostile_job(tmp_path)), timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    faked = [line for line in lines if "JobSucceeded" in line]
    assert faked == ["[rank0]: " + safe_text(HOSTILE)]  # the prefix leads; nothing to obey
    assert "\x1b" not in done.stdout and "\r" not in done.stdout and "\x07" not in done.stdout
    assert "[rank0]: tab\there, café ✓" in lines
    assert "[rank0]: not utf-8: \\xff\\xfe" in lines
    job = tg.only_job()
    logs = Path(job["logs_dir"])
    assert HOSTILE.encode() in (logs / "console.log").read_bytes()  # the files keep the bytes
    assert b"not utf-8: \xff\xfe\n" in (logs / "rank-0.log").read_bytes()
    # `trainguard logs` into a pipe: the bytes as written (not a terminal's to interpret).
    piped = subprocess.run(
        tg.argv("logs", job["id"], "--rank", "0"), env=tg.env, capture_output=True,
        cwd=REPO, timeout=60,
    )  # fmt: skip
    assert piped.returncode == 0
    assert HOSTILE.encode() in piped.stdout and b"\xff\xfe" in piped.stdout


def test_a_console_read_by_head_does_not_end_the_job(tg: Trainguard, tmp_path: Path) -> None:
    """`trainguard run ... 2>&1 | head -1` killed the controller (exit 141): the job
    was lost. The console's writes are dropped; the job runs to its end."""
    head = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert head.stdin is not None
    try:
        run = subprocess.run(
            tg.argv("run", "--nproc-per-node", "2", str(_hostile_job(tmp_path))),
            env=tg.env, stdout=head.stdin, stderr=subprocess.STDOUT, cwd=REPO, timeout=120,
        )  # fmt: skip
    finally:
        head.stdin.close()
        assert head.stdout is not None
        first = head.stdout.read()
        head.wait(timeout=30)
    assert first.startswith(b"[trainguard] job ")
    assert run.returncode == 0
    job = tg.only_job()
    assert job["phase"] == "Succeeded"
    assert (Path(job["logs_dir"]) / "console.log").read_bytes().count(b"filler 399") == 2


class _ClosedPipe(io.BytesIO):
    def write(self, data: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_another_hosts_daemon_shows_its_ranks_lines_escaped_and_survives_its_console() -> None:
    """On a host that joined a job, the daemon copies its agents' consoles to its own."""
    shown = io.BytesIO()
    daemon = HostDaemon(
        JobEndpoint("127.0.0.1", 1), "token", LocalAddress("127.0.0.1", "lo"), {},
        lambda reply: None,  # type: ignore[arg-type,return-value]
        out=shown,
    )  # fmt: skip
    try:
        lines = f"[rank2]: {HOSTILE}\n[rank2]: after\n".encode()
        daemon.agents._pump(io.BytesIO(lines))
        assert shown.getvalue().decode() == f"[rank2]: {safe_text(HOSTILE)}\n[rank2]: after\n"
        agent = io.BytesIO(lines * 100)
        daemon._out = _ClosedPipe()
        daemon.agents._pump(agent)  # no reader: the lines are dropped, the agent's pipe drained
        assert agent.tell() == len(lines) * 100
    finally:
        daemon.server.close()


def test_describe_and_list_show_worker_text_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """A fault's message or a worker event's is the worker's text too."""
    _table([["KIND", "MESSAGE"], ["Fault", "ValueError: " + HOSTILE + "\nsecond line"]])
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\r" not in shown
    assert shown.splitlines()[1].endswith(safe_cell(HOSTILE) + "\\nsecond line")


def test_a_workers_error_quoted_by_an_event_stays_on_its_line(
    tg: Trainguard, tmp_path: Path
) -> None:
    """The reason of a failure quotes the worker's exception: its escapes must not
    return to the start of the line and pass for trainguard's."""
    script = tmp_path / "raises.py"
    fake = "[trainguard] 99:99:99 JobSucceeded: all ranks completed (FAKE)"
    script.write_text(f"raise ValueError({('boom' + chr(27) + '[2J' + chr(13) + fake)!r})\n")
    done = tg.run("run", "--max-restarts", "0", "--nproc-per-node", "1", str(script))
    assert done.returncode == 1
    assert "\x1b" not in done.stderr and "\x1b" not in done.stdout
    lines = (done.stdout + done.stderr).splitlines()
    assert not [line for line in lines if line.startswith("[trainguard] 99:99:99")]
    [failed] = [line for line in lines if line.startswith("[trainguard]") and "JobFailed" in line]
    assert "ValueError: boom\\x1b[2J" in failed  # shown, not obeyed
