"""``trainguard run --metrics-*``: bad values and a busy port are usage errors, and the
endpoint is on loopback unless asked otherwise."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

from conftest import FAKE_WORKER, Trainguard


def test_bad_metrics_flags_are_usage_errors(tg: Trainguard) -> None:
    for flags, field in (
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--metrics-port", "x"], "--metrics-port"),
        (["--metrics-port", "0", "--metrics-linger", "inf"], "--metrics-linger"),
        (["--metrics-port", "0", "--metrics-linger", "-1"], "--metrics-linger"),
    ):
        done = tg.run("run", *flags, str(FAKE_WORKER))
        assert done.returncode == 2, (flags, done.stderr)
        assert field in done.stderr, done.stderr


def test_a_busy_metrics_port_is_a_usage_error_and_starts_nothing(tg: Trainguard) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = tg.run("run", "--metrics-port", str(port), str(FAKE_WORKER))
    assert done.returncode == 2, done.stderr
    assert f"--metrics-port {port}: cannot listen on 127.0.0.1" in done.stderr
    assert tg.run("list", "-o", "json").stdout.strip() == "[]"  # no job was recorded


def test_metrics_are_served_on_loopback_until_the_linger_ends(
    tg: Trainguard, tmp_path: Path
) -> None:
    proc = tg.popen(
        "run", "--metrics-port", "0", "--metrics-linger", "3", str(FAKE_WORKER),
        "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert proc.stderr is not None
    url = None
    lingering = False
    for line in proc.stderr:  # "[trainguard] metrics: http://127.0.0.1:PORT/metrics" first
        found = re.search(r"metrics: (http://\S+/metrics)", line)
        url = url or (found.group(1) if found else None)
        if "serving 3 s more" in line:
            lingering = True
            break
    assert url is not None and url.startswith("http://127.0.0.1:"), url
    assert lingering
    with urllib.request.urlopen(url, timeout=10) as reply:  # the job has ended: final values
        page = reply.read().decode()
    assert proc.wait(60) == 0
    assert "trainguard_jobs_successful_total 1.0" in page
    assert re.search(r'trainguard_goodput_ratio\{job="fake-worker"\} 0\.\d+', page), page
    assert 'trainguard_nodes{job="fake-worker",state="completed"} 1.0' in page
