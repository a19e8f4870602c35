"""``trainguard report``: the page from a history built here, the main figure's fault
markers read back from its pixels, and a real run's report opened in headless Chromium
(the Debian ``chromium`` package, installed on first use when it is missing)."""

from __future__ import annotations

import fcntl
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from conftest import REPO, SCRIPTS, Trainguard, wait_for
from trainguard.control.events import Event
from trainguard.control.resume import RecordedAttempt
from trainguard.observe.account import account
from trainguard.observe.durable import DurableState, durable_state
from trainguard.observe.figures import FAULT_COLOR, Png, pace_figure, progress_figure
from trainguard.observe.history import JOB, JobHistory, SeriesSample
from trainguard.observe.report import png_path, render, why_failed

T0 = 1_700_000_000.0
EVIL = '<script>alert("x")</script> & co'
GOODPUT = re.compile(r'<span id="goodput" data-value="([^"]*)">([^<]*)</span>')


def _progress(
    attempt: int, start: float, first: int, last: int, every: int = 10
) -> list[SeriesSample]:
    """An attempt's progress: a step every 0.1 s from ``first`` to ``last``."""
    steps = [*range(first, last, every), last]
    return [SeriesSample(start + (s - first) * 0.1, attempt, JOB, float(s)) for s in steps]


def _fault(t: float, attempt: int, step: int, **extra: Any) -> dict[str, Any]:
    fault: dict[str, Any] = {
        "type": "WorkerCrash",
        "time": t,
        "attempt": attempt,
        "node": "node-0",
        "rank": 1,
        "step": step,
        "message": "rank 1 exited with signal SIGKILL <b>boom</b>",
        "evidence": {"exitcode": -9, "injected": "kill:rank=1@step=100"},
        "detected_at": t,
        "fault_step": step,
        "scope": "process",
        "recovered_at": t + 2.0,
        "recovery_seconds": 2.0,
        "resumed_step": 50,
        "lost_steps": step - 50,
    }
    fault.update(extra)
    return fault


def _history(**changes: Any) -> JobHistory:
    """A finished job: attempt 0 runs steps 1..100, a kill at t+13, attempt 1 resumes at
    51 and runs to 300; a hang in attempt 1 is recovered in-process."""
    samples = _progress(0, T0 + 2.0, 1, 100) + _progress(1, T0 + 16.0, 51, 300)
    paces = [
        SeriesSample(T0 + t, a, rank, 0.1 * (1.6 if rank == 3 else 1.0))
        for t, a in ((5.0, 0), (20.0, 1), (30.0, 1))
        for rank in range(4)
    ]
    events = (
        Event(T0 + 4.0, "CheckpointSaved", "step 20", data={"step": 20, "tier": "memory"}),
        Event(
            T0 + 9.0,
            "CheckpointSaved",
            "step 50",
            data={"tier": "memory", "step": 50, "blocking_seconds": [0.012, 0.02]},
        ),
        Event(T0 + 9.5, "CheckpointCommitted", "c", data={"step": 50, "tier": "durable"}),
        Event(T0 + 9.6, "CheckpointCommitted", "rank 0's note", rank=0, data={"step": 50}),
        *(
            Event(
                T0 + 15.5,
                "CheckpointRestored",
                "r",
                attempt=1,
                rank=r,
                data={"step": 50, "tier": "memory", "seconds": 0.05 + r / 100},
            )
            for r in range(4)
        ),
        Event(T0 + 31.0, "Straggler", f"rank 3 {EVIL} is a straggler", attempt=1, rank=3),
    )
    history = JobHistory(
        job_id="job-1",
        name=EVIL,
        phase="Succeeded",
        created_at=T0,
        started_at=T0,
        finished_at=T0 + 42.0,
        restarts=2,
        attempts=(
            RecordedAttempt(0, "Failed", T0, T0 + 14.0, "rank 1 exited"),
            RecordedAttempt(1, "Succeeded", T0 + 14.0, T0 + 42.0, EVIL),
        ),
        events=events,
        faults=(
            _fault(T0 + 13.0, 0, 100),
            _fault(
                T0 + 25.0,
                1,
                140,
                type="LogHang",
                scope="inprocess",
                evidence={},
                message=f"no progress {EVIL}",
                lost_steps=0,
            ),
        ),
        samples=tuple(samples + paces),
    )
    return replace(history, **changes)


def _goodput(page: str) -> tuple[str, str]:
    found = GOODPUT.search(page)
    assert found, "no goodput element"
    return found.group(1), found.group(2)


def _external_references(page: str) -> list[str]:
    """src/href values that are not inline data or a fragment, and any URL in the text."""
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    bad = [r for r in refs if not r.startswith(("data:", "#"))]
    return bad + re.findall(r"(?:https?|ftp)://", page) + re.findall(r"url\(", page)


def test_report_has_the_faults_goodput_and_escapes_the_job_strings() -> None:
    history = _history()
    now = T0 + 100.0
    report = render(history, now, world_size=4)
    page = report.html
    acc = account(history, now)

    value, shown = _goodput(page)
    assert acc.goodput is not None
    assert float(value) == acc.goodput == report.accounting.goodput
    assert shown == f"{acc.goodput:.1%}"

    # Every string from the job is escaped: no markup of its own reaches the page.
    assert "<script" not in page and "<b>boom" not in page
    assert html.escape(EVIL) in page
    assert "&lt;b&gt;boom&lt;/b&gt;" in page
    assert _external_references(page) == []

    faults = page.split("<h2>Faults</h2>")[1].split("</section>")[0]
    rows = re.findall(r"<tr>(.*?)</tr>", faults.split("<tbody>")[1])
    assert len(rows) == 2
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows]
    assert "WorkerCrash" in cells[0][1] and cells[0][2] == "yes (kill:rank=1@step=100)"
    assert cells[0][3:11] == ["0", "node-0", "1", "100", "50", "process", "2.00", "50"]
    assert "LogHang" in cells[1][1] and cells[1][2] == "no" and cells[1][8] == "inprocess"

    # Downtime by cause, from the same accounting.
    for cause, seconds in acc.downtime_seconds().items():
        if seconds > 0:
            assert f"<td>{cause}</td><td>{seconds:.1f} s</td>" in page
    # Per-rank step times, the straggler, checkpoints by tier (one durable commit, not two).
    assert "Ranks by median step time" in page and "<td>3</td><td>0.1600</td>" in page
    assert "Stragglers" in page
    assert "<td>memory</td><td>2</td><td>20, 50</td><td>0.016 / 0.020</td>" in page
    assert "<td>durable</td><td>1</td><td>50</td>" in page
    assert "<td>1</td><td>memory</td><td>50</td><td>4</td><td>0.065 / 0.080</td>" in page
    assert page.count("data:image/png;base64,") == 2


def test_a_failed_jobs_report_starts_with_why_it_failed() -> None:
    """The reason the controller gave up with, the rank's exception in it, escaped; none
    for a job that did not fail (friction: a failed job's report never said why)."""
    reason = (
        f"rank 1 exited with exit code 1: ValueError: {EVIL}; retry budget exhausted "
        "(--max-restarts=3, restarts=3)"
    )
    failed = _history(
        phase="Failed",
        events=(
            Event(T0 + 1.0, "JobFailed", "an older reason"),  # the last one is the job's
            Event(T0 + 41.0, "JobFailed", reason),
        ),
    )
    page = render(failed, T0 + 100.0).html
    why = re.search(r'<p id="why"[^>]*>(.*?)</p>', page)
    assert why is not None
    assert "Why it failed:" in why.group(1) and html.escape(reason) in why.group(1)
    assert page.index('id="why"') < page.index("<h2>")  # at the top
    assert 'id="why"' not in render(_history(), T0 + 100.0).html


def test_a_failed_jobs_report_blames_the_silence_that_started_the_failure() -> None:
    """Issue 39: host1 went silent, node-1 was lost, and every restart after it failed to
    launch node-1's agent: the report named 'agent could not be launched'. The silence
    comes first now; a job that recovered since a fault is blamed on its last one."""
    launch = "node-1 lost: its agent could not be launched: no host can run node-1"
    reason = f"{launch}; retry budget exhausted (--max-restarts=1, restarts=1)"
    silence = {"type": "NodeLost", "node": "node-1", "evidence": {"failed_contacts": 3,
               "gone": None}}  # fmt: skip
    cut = "node-1 lost: its agent did not answer 3 contacts in a row over 8.1s (limit 3)"
    events = (
        Event(T0 + 1.0, "Fault", "rank 1 exited with signal SIGKILL", 0, "node-0", 1,
              {"type": "WorkerCrash", "evidence": {"exitcode": -9}}),
        Event(T0 + 2.0, "Recovered", "WorkerCrash of attempt 0 recovered", 1),
        Event(T0 + 10.0, "Fault", cut, 1, "node-1", None, silence),
        Event(T0 + 11.0, "RestartScheduled", "full job restart", 1),
        Event(T0 + 12.0, "Fault", launch, 2, "node-1", None, {"type": "NodeLost"}),
        Event(T0 + 13.0, "JobFailed", reason, 2),
    )  # fmt: skip
    why = why_failed(_history(phase="Failed", events=events))
    assert why is not None and why.startswith("node-1's host went silent at "), why
    assert f"(attempt 1: {cut}); no attempt after it completed a step" in why, why
    assert why.endswith(f"the job failed on: {reason}"), why
    page = render(_history(phase="Failed", events=events), T0 + 100.0).html
    assert html.escape("node-1's host went silent") in page
    # Recovered since the silence: the job failed on its last fault, named alone.
    again = (*events[:-1], Event(T0 + 20.0, "Recovered", "NodeLost recovered", 3),
             Event(T0 + 30.0, "Fault", launch, 3, "node-1"), events[-1])  # fmt: skip
    assert why_failed(_history(phase="Failed", events=again)) == reason
    # A node whose agent is known gone (it exited) did not go silent.
    gone = {"type": "NodeLost", "evidence": {"failed_contacts": 0, "gone": "agent exited"}}
    exited = (replace(events[2], data=gone), *events[3:])
    assert "went silent" not in (why_failed(_history(phase="Failed", events=exited)) or "")
    # Another fault type started it: named first; the same type again: the reason alone.
    crash = Event(T0 + 10.0, "Fault", "rank 3 exited with exit code 1", 1, "node-1", 3,
                  {"type": "WorkerCrash"})  # fmt: skip
    assert (why_failed(_history(phase="Failed", events=(crash, *events[3:]))) or "").startswith(
        "attempt 1: rank 3 exited with exit code 1; no attempt after it completed a step"
    )
    again = Event(T0 + 12.0, "Fault", "rank 2 exited with exit code 1", 2, "node-1", 2,
                  {"type": "WorkerCrash"})  # fmt: skip
    ended = Event(T0 + 13.0, "JobFailed", "rank 2 exited with exit code 1; retry budget", 2)
    assert why_failed(_history(phase="Failed", events=(crash, again, ended))) == ended.message


def test_the_report_shows_the_newest_durable_step_and_a_missing_final_one() -> None:
    """Issue 38: a job whose newest asked-for step never became durable must not look
    clean. The events (controller's and rank 0's commits, a lost persist, the end's
    CheckpointNotDurable) say the newest durable step is 100, the schedule asked for 400."""
    events = (
        Event(T0 + 1.0, "CheckpointPersisting", "p", data={"step": 100}),
        Event(T0 + 2.0, "CheckpointCommitted", "c", data={"step": 80, "tier": "durable"}),
        Event(T0 + 2.5, "CheckpointCommitted", "rank 0's", rank=0, data={"step": 100}),
        Event(T0 + 2.6, "CheckpointCommitted", "memory", data={"step": 120, "tier": "memory"}),
        Event(T0 + 3.0, "CheckpointPersistFailed", "lost", data={"step": 200}),
        Event(T0 + 40.0, "CheckpointNotDurable", "warning", data={"step": 400}),
    )
    state = durable_state(events)
    assert state.to_json() == {
        "durable_step": 100,
        "asked_step": 400,
        "missing": True,
        "failed_persists": 1,
    }
    assert state.line() == "step 100 (the schedule asked for 400: not durable); 1 failed persist"
    assert DurableState.from_json(state.to_json()) == state
    page = render(_history(events=events), T0 + 100.0).html
    shown = re.search(r'<p id="durable"([^>]*)>(.*?)</p>', page)
    assert shown is not None and FAULT_COLOR in shown.group(1)
    assert "step 100 (the schedule asked for 400: not durable)" in shown.group(2)
    clean = render(_history(), T0 + 100.0).html
    assert "<b>Newest durable step:</b> step 50</p>" in clean
    assert durable_state(()).line() == "-" and not durable_state(()).missing
    # A persist on its way is not missing; once it failed, or the job ended without it, it is.
    flight = (
        Event(T0 + 1.0, "CheckpointCommitted", "c", data={"step": 380, "tier": "durable"}),
        Event(T0 + 2.0, "CheckpointPersisting", "p", data={"step": 400}),
    )
    state = durable_state(flight)
    assert not state.missing and state.line() == "step 380 (step 400 being persisted)"
    failed = Event(T0 + 3.0, "CheckpointPersistFailed", "f", data={"step": 400})
    assert durable_state((*flight, failed)).missing
    retried = Event(T0 + 4.0, "CheckpointCommitted", "c", data={"step": 400})
    assert durable_state((*flight, failed, retried)).line() == "step 400; 1 failed persist"


def test_report_of_a_running_job_without_samples_or_faults() -> None:
    history = _history(
        phase="Running", finished_at=None, faults=(), samples=(), events=(), attempts=()
    )
    now = T0 + 30.0
    page = render(history, now).html
    value, shown = _goodput(page)
    acc = account(history, now)
    assert acc.goodput == 0.0 and float(value) == acc.goodput and shown == "0.0%"
    assert "running (as of" in page
    assert "No faults." in page
    assert "No per-rank step times were recorded" in page
    assert "No checkpoint saves or restores were recorded." in page
    assert page.count("data:image/png;base64,") == 1  # the main figure only

    # Not started yet, no time passed: no goodput at all.
    empty = _history(phase="Pending", started_at=None, finished_at=None, samples=(), faults=())
    value, shown = _goodput(render(empty, T0).html)
    assert (value, shown) == ("", "-")


def _red(image: Image.Image) -> npt.NDArray[np.bool_]:
    """Where the image is red like the fault markers (antialiased edges included)."""
    rgb = np.asarray(image.convert("RGB")).astype(int)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return (r >= 170) & (g <= 100) & (b <= 100)


def _red_pixels(image: Image.Image, columns: range, rows: range) -> int:
    return int(_red(image)[rows.start : rows.stop, columns.start : columns.stop].sum())


def _longest_marker_line(image: Image.Image) -> int:
    """The longest vertical run of pixels of exactly the fault marker's colour."""
    rgb = np.asarray(image.convert("RGB")).astype(int)
    marker = np.array([int(FAULT_COLOR[i : i + 2], 16) for i in (1, 3, 5)])
    hit = (np.abs(rgb - marker) <= 16).all(axis=2)
    longest = 0
    for column in hit.T:
        run = 0
        for h in column:
            run = run + 1 if h else 0
            longest = max(longest, run)
    return longest


def _column(png: Png, t: float) -> float:
    """The pixel column of time ``t`` (seconds since the start), from the plot area."""
    left, _, right, _ = png.axes
    lo, hi = png.xlim
    return left + (t / png.unit - lo) / (hi - lo) * (right - left)


def test_main_figure_marks_each_fault_at_its_time() -> None:
    history = _history()
    acc = account(history, T0 + 100.0)
    png = progress_figure(history, acc)
    image = Image.open(io.BytesIO(png.data)).convert("RGB")
    assert image.size == (png.width, png.height)
    assert FAULT_COLOR == "#d62728"
    _, top, _, bottom = png.axes
    rows = range(int(top) + 2, int(bottom) - 2)
    for fault, marker in zip(history.faults, png.fault_x, strict=True):
        x = _column(png, fault["detected_at"] - T0)
        assert abs(marker - x) < 1.0
        # A red line at the fault's time, over most of the plot's height ...
        near = range(int(x) - 2, int(x) + 3)
        assert _red_pixels(image, near, rows) >= 0.8 * len(rows), fault["type"]
        # ... and not a few pixels away from it (other than the label and the cross).
        away = range(int(x) + 12, int(x) + 16)
        assert _red_pixels(image, away, rows) < 0.1 * len(rows)

    # The same job without faults: no red anywhere.
    calm = replace(history, faults=())
    png = progress_figure(calm, account(calm, T0 + 100.0))
    image = Image.open(io.BytesIO(png.data)).convert("RGB")
    assert png.fault_x == ()
    assert _red_pixels(image, range(image.width), range(image.height)) == 0


def test_many_ranks_are_a_heatmap_with_the_straggler_hot() -> None:
    """Beyond 16 ranks, each rank's pace relative to the median, as colour; rank 7 is
    twice as slow, rank 30 has no recording at 20 s, and none is made between 20 s and
    40 s (the job was down)."""
    paces = [
        SeriesSample(T0 + t, 0, rank, 0.2 if rank == 7 else 0.1)
        for t in (10.0, 20.0, 40.0, 50.0)
        for rank in range(32)
        if (rank, t) != (30, 20.0)
    ]
    history = _history(samples=tuple(_progress(0, T0 + 2.0, 1, 400) + paces), faults=())
    acc = account(history, T0 + 100.0)
    png = pace_figure(history, acc)
    assert png is not None
    image = np.asarray(Image.open(io.BytesIO(png.data)).convert("RGB")).astype(int)
    _, top, _, bottom = png.axes

    def cell(rank: int, t: float) -> npt.NDArray[np.int_]:
        x = _column(png, t - 5.0)  # the cell of the recording at t covers (t - 10, t]
        y = bottom - (rank + 0.5) / 32 * (bottom - top)
        pixel: npt.NDArray[np.int_] = image[int(y), int(x)]
        return pixel

    hot, even = cell(7, 20.0), cell(3, 20.0)
    assert hot[0] > 150 and hot[2] < 100, hot  # red: slower than the median
    assert (even > 170).all() and even[2] < 230, even  # pale yellow: the median
    assert (cell(3, 30.0) == 255).all()  # no recording in (20, 30]: blank
    page = render(history, T0 + 100.0).html
    assert page.count("data:image/png;base64,") == 2
    assert "(16 slowest shown)" in page and "<td>7</td><td>0.2000</td>" in page


def test_png_beside_the_page() -> None:
    assert png_path(Path("out/a.html")) == Path("out/a.png")
    assert png_path(Path("report")) == Path("report.png")
    assert png_path(Path("x.png")) == Path("x.png.png")


def test_the_cli_does_not_import_matplotlib_and_an_unknown_job_is_a_usage_error(
    tg: Trainguard,
) -> None:
    probe = "import sys, trainguard.cli; print('matplotlib' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.stdout.strip() == "False", done.stderr
    done = tg.run("report", "no-such-job")
    assert done.returncode == 2
    assert "no job 'no-such-job'" in done.stderr


# -- a real run in headless Chromium -----------------------------------------------------

CHROMIUM_LOCK = Path("/tmp/trainguard-chromium-install.lock")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",  # a container's /dev/shm is small
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
)


def _find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def chromium() -> Iterator[str]:
    """The Debian chromium package's browser, installed with apt-get if missing (one
    installer at a time across xdist workers)."""
    found = _find_chromium()
    if found is None:
        if shutil.which("apt-get") is None:
            pytest.skip("chromium is not installed and there is no apt-get to install it")
        with open(CHROMIUM_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = _find_chromium()
            if found is None:
                started = time.monotonic()
                env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
                for argv in (
                    ["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                ):
                    done = subprocess.run(
                        argv, env=env, capture_output=True, text=True, timeout=1200
                    )
                    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr}"
                found = _find_chromium()
                assert found, "apt-get installed chromium, but it is not on PATH"
                print(f"chromium installed in {time.monotonic() - started:.1f} s", file=sys.stderr)
    yield found


def _open(
    chromium: str, page: Path, work: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Load ``page`` in headless Chromium; returns the run and the URLs the page itself
    requested from the network (from Chromium's net log)."""
    net_log = work / f"net-{len(list(work.glob('net-*')))}.json"
    done = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={work / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            f"--log-net-log={net_log}",
            *extra,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, _page_requests(net_log)


def _page_requests(net_log: Path) -> list[str]:
    """URLs requested by the page (its network isolation key is the file:// origin),
    not by the browser's own background services."""
    text = net_log.read_text()
    try:
        log = json.loads(text)
    except json.JSONDecodeError:  # written until the browser exited: close it
        log = json.loads(text.rstrip().rstrip(",") + "]}")
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [
        e["params"]["url"]
        for e in log["events"]
        if e["type"] == start_job and "file://" in e["params"].get("network_isolation_key", "")
    ]


def _console_errors(stderr: str) -> list[str]:
    return [
        line
        for line in stderr.splitlines()
        if ":CONSOLE" in line or "Uncaught" in line or "net::ERR_" in line
    ]


def test_chromium_check_sees_console_errors_and_page_requests(
    chromium: str, tmp_path: Path
) -> None:
    """The checks below are not vacuous: a broken page fails them."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<html><body><img src='http://example.invalid/x.png'>"
        "<script>console.error('boom'); missing();</script></body></html>"
    )
    done, requests = _open(chromium, bad, tmp_path, "--dump-dom")
    errors = _console_errors(done.stderr)
    assert any("boom" in line for line in errors), done.stderr[-3000:]
    assert any("Uncaught" in line for line in errors)
    assert requests == ["http://example.invalid/x.png"]


@pytest.mark.e2e
def test_report_of_a_real_run_opens_in_chromium(
    chromium: str, tg: Trainguard, tmp_path: Path
) -> None:
    console = open(tmp_path / "run.log", "w+")  # noqa: SIM115 (closed below)
    run = subprocess.Popen(
        tg.argv(
            "run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--inject",
            "kill:rank=1@step=100",
            str(SCRIPTS / "step_worker.py"),
            "1200",
        ),
        env=tg.env,
        stdout=console,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    out = tmp_path / "out"
    out.mkdir()
    try:
        # While it runs: the report reads the store, its end is now.
        def progressing() -> bool:
            done = tg.run("list", "-o", "json", timeout=60)
            jobs = json.loads(done.stdout) if done.returncode == 0 else []
            if not jobs or jobs[0]["phase"] != "Running":
                return False
            return int(tg.describe(jobs[0]["id"])["accounting"]["kept_steps"]) > 0

        wait_for(progressing, timeout=120)
        done = subprocess.run(
            [*tg.argv("report", "step-worker", "-o", str(out / "live.html"))],
            env=tg.env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=out,
        )
        assert done.returncode == 0, done.stderr
        live = (out / "live.html").read_text()
        assert "running (as of" in live and (out / "live.png").stat().st_size > 0
        assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        console.close()

    info = tg.only_job()
    assert info["phase"] == "Succeeded" and len(info["faults"]) == 1
    # After: the default file names, in the current directory, both printed.
    done = subprocess.run(
        tg.argv("report", info["name"]),
        env=tg.env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out,
    )
    assert done.returncode == 0, done.stderr
    page = out / f"{info['id']}-report.html"
    png = out / f"{info['id']}-report.png"
    assert done.stdout.split() == [page.name, png.name]
    assert _external_references(page.read_text()) == []

    shot = tmp_path / "shot.png"
    done, requests = _open(
        chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2000"
    )
    assert _console_errors(done.stderr) == [], done.stderr[-3000:]
    assert requests == []
    screen = Image.open(shot).convert("RGB")
    assert screen.size == (1280, 2000)
    colors = screen.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50, "a blank screenshot"
    # The embedded main figure was decoded and drawn: its fault marker is on screen.
    assert _longest_marker_line(screen) > 100

    done, requests = _open(chromium, page, tmp_path, "--dump-dom")
    assert _console_errors(done.stderr) == [] and requests == []
    value, shown = _goodput(done.stdout)
    goodput = tg.describe(info["id"])["accounting"]["goodput"]
    assert float(value) == goodput == info["accounting"]["goodput"]
    assert shown == f"{goodput:.1%}"
    assert "WorkerCrash" in done.stdout
    assert "kill:rank=1@step=100" in done.stdout  # the fault is marked injected
