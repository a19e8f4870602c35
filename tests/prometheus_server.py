"""A real Prometheus for tests: the Debian ``prometheus`` package, on 127.0.0.1.

Reusable by any test module (``from prometheus_server import prometheus_binary, ...``):

- ``prometheus_binary`` (session scope) makes sure the ``prometheus`` command exists:
  if it is not on PATH it runs ``apt-get update`` and ``apt-get install prometheus``
  (once per machine: a file lock keeps xdist workers from racing), without letting the
  package start its own service; it skips the test where there is no ``apt-get``;
- :func:`running_prometheus` starts a server that scrapes the given loopback targets
  every second (``honor_labels``: the targets' own ``job`` label is kept), in a private
  storage directory on a free port, waits until it is ready, yields a
  :class:`Prometheus` and stops it;
- :class:`Prometheus` answers PromQL through the HTTP API (``/api/v1/query``,
  ``/api/v1/query_range``) with urllib; a query that does not parse raises
  :class:`PromQLError`.

Nothing listens beyond loopback, and nothing is left running: the package's own
service (which would listen on every interface, port 9090) is kept from starting, and
stopped if it started anyway.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from s3_server import free_port

__all__ = [
    "PromQLError",
    "Prometheus",
    "Sample",
    "ensure_prometheus",
    "prometheus_binary",
    "running_prometheus",
]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SCRAPE_JOB = "trainguard-test"
"""The scrape job's name: the ``job`` label of ``up`` (the targets' metrics keep theirs)."""
SCRAPE_INTERVAL = 1.0
INSTALL_TIMEOUT = 900.0
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
QUERY_TIMEOUT = 10.0
INSTALL_LOCK = Path(tempfile.gettempdir()) / "trainguard-prometheus-install.lock"
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
"""Debian's hook that tells package scripts whether they may start services."""
SERVICE = "prometheus"
DEBIAN_PORT = 9090
"""Where the package's own service would listen (all interfaces)."""

Sample = tuple[dict[str, str], float]
"""One series of an instant query: its labels and its value."""

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy


class PromQLError(RuntimeError):
    """Prometheus refused a query (``errorType`` and ``error`` of its answer)."""


# -- install ------------------------------------------------------------------------------


def ensure_prometheus() -> str:
    """The path of the ``prometheus`` command, installed with apt-get if it is missing.

    Skips the calling test where the package cannot be installed here (no ``apt-get``,
    not root); fails it when the install itself fails. Holds a file lock meanwhile, so
    concurrent test processes install once.
    """
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("prometheus is not installed and there is no apt-get to install it")
    if os.geteuid() != 0:
        pytest.skip("prometheus is not installed and installing it needs root (apt-get)")
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it now
        try:
            found = shutil.which("prometheus")
            if found:
                return found
            started = time.monotonic()
            _apt_install()
            log.warning("prometheus installed in %.1f s", time.monotonic() - started)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    found = shutil.which("prometheus")
    if not found:
        pytest.fail("apt-get installed prometheus, but there is no prometheus command on PATH")
    return found


def _apt_install() -> None:
    """``apt-get update`` and install the package, its service kept from starting."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    options = ["-q", "-o", "DPkg::Lock::Timeout=300"]
    commands = [
        ["apt-get", *options, "update"],
        ["apt-get", *options, "install", "-y", "--no-install-recommends", "prometheus"],
    ]
    own_policy = not POLICY_RC_D.exists()
    if own_policy:
        # The package's postinst starts its init.d service unless policy-rc.d says 101
        # ("action forbidden"); Docker images ship one, a fresh machine may not.
        POLICY_RC_D.write_text(
            "#!/bin/sh\n# trainguard tests: no services during install\nexit 101\n"
        )
        POLICY_RC_D.chmod(0o755)
    try:
        for command in commands:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT
            )
            if done.returncode != 0:
                pytest.fail(
                    f"{' '.join(command)} failed ({done.returncode}):\n"
                    f"{(done.stdout + done.stderr)[-3000:]}"
                )
    finally:
        if own_policy:
            POLICY_RC_D.unlink(missing_ok=True)
    _stop_package_service()


def _stop_package_service() -> None:
    """Stop and disable the Debian service if it was started anyway."""
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        subprocess.run(["systemctl", "disable", "--now", SERVICE], capture_output=True, timeout=60)
    init_script = Path("/etc/init.d") / SERVICE
    if init_script.exists():
        subprocess.run([str(init_script), "stop"], capture_output=True, timeout=60)
    if _listening(DEBIAN_PORT):
        log.warning("port %d is still taken after stopping the prometheus service", DEBIAN_PORT)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    """The ``prometheus`` command (installed on first use; see :func:`ensure_prometheus`)."""
    return ensure_prometheus()


# -- a running server ---------------------------------------------------------------------


@dataclass(frozen=True)
class Prometheus:
    """A running Prometheus server and its HTTP API."""

    url: str
    targets: tuple[str, ...]
    scrape_job: str = SCRAPE_JOB

    def api(self, path: str, **params: str | Sequence[str]) -> Any:
        """The ``data`` of a GET to ``/api/v1/<path>``; PromQLError when it is refused."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with _OPENER.open(f"{self.url}/api/v1/{path}?{query}", timeout=QUERY_TIMEOUT) as r:
                body = json.load(r)
        except urllib.error.HTTPError as err:  # 400 (bad query), 422 (cannot execute)
            try:
                body = json.load(err)
            except ValueError:
                raise PromQLError(f"{path}: HTTP {err.code}") from None
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')} ({params})")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        """An instant query (at unix time ``at``, else now): (labels, value) per series.

        A scalar answer is one series with no labels; a range vector is refused (use
        :meth:`samples`).
        """
        params = {"query": promql} | ({"time": repr(at)} if at is not None else {})
        data = self.api("query", **params)
        kind, result = data["resultType"], data["result"]
        if kind == "vector":
            return [(dict(s["metric"]), float(s["value"][1])) for s in result]
        if kind == "scalar":
            return [({}, float(result[1]))]
        raise PromQLError(f"{promql!r} is a {kind}, not an instant vector")

    def samples(
        self, selector: str, at: float | None = None
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """The raw samples of a range selector (``metric[5m]``): (labels, [(time, value)])."""
        params = {"query": selector} | ({"time": repr(at)} if at is not None else {})
        data = self.api("query", **params)
        if data["resultType"] != "matrix":
            raise PromQLError(f"{selector!r} is a {data['resultType']}, not a range vector")
        return [
            (dict(s["metric"]), [(float(t), float(v)) for t, v in s["values"]])
            for s in data["result"]
        ]

    def query_range(
        self, promql: str, start: float, end: float, step: float = SCRAPE_INTERVAL
    ) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """A range query, as a dashboard panel makes it: (labels, [(time, value)])."""
        data = self.api(
            "query_range", query=promql, start=repr(start), end=repr(end), step=repr(step)
        )
        return [
            (dict(s["metric"]), [(float(t), float(v)) for t, v in s["values"]])
            for s in data["result"]
        ]

    def label_values(self, label: str, match: str) -> list[str]:
        """Values of ``label`` on series matching ``match`` (Grafana's ``label_values``)."""
        values: list[str] = self.api(f"label/{label}/values", **{"match[]": [match]})
        return values

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[Sample]], bool],
        timeout: float = 60.0,
    ) -> list[Sample]:
        """Query until ``predicate(result)`` is true; its result. AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        result = self.query(promql)
        while not predicate(result):
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql!r} still {result} after {timeout} s")
            time.sleep(0.2)
            result = self.query(promql)
        return result

    def last_scrape(self, target: str, window: str = "1h") -> float | None:
        """Unix time of ``target``'s newest successful scrape in ``window``; None if none."""
        series = self.samples(f'up{{job="{self.scrape_job}",instance="{target}"}}[{window}]')
        times = [t for _, values in series for t, up in values if up == 1.0]
        return max(times, default=None)


def _config(targets: Sequence[str], scrape_job: str, interval: float) -> dict[str, Any]:
    seconds = f"{interval:g}s"
    return {
        "global": {
            "scrape_interval": seconds,
            "scrape_timeout": seconds,
            "evaluation_interval": seconds,
        },
        "scrape_configs": [
            {
                "job_name": scrape_job,
                # trainguard's metrics carry a `job` label of their own (the training
                # job); without this Prometheus renames it to `exported_job`.
                "honor_labels": True,
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }


def _wait_until_ready(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"prometheus exited with {proc.returncode} before it was ready:\n"
                f"{log_path.read_text()[-3000:]}"
            )
        try:
            with _OPENER.open(f"{url}/-/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"prometheus was not ready on {url} within {START_TIMEOUT} s")


@contextmanager
def running_prometheus(
    binary: str,
    targets: Sequence[str],
    workdir: Path,
    interval: float = SCRAPE_INTERVAL,
    scrape_job: str = SCRAPE_JOB,
) -> Iterator[Prometheus]:
    """A Prometheus on a free loopback port scraping ``targets`` (``host:port``) every
    ``interval`` seconds, its config, data and log under ``workdir``; stopped on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(targets, scrape_job, interval)))
    port = free_port()
    url = f"http://{HOST}:{port}"
    log_path = workdir / "prometheus.log"
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address={HOST}:{port}",
    ]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        _wait_until_ready(proc, url, log_path)
        yield Prometheus(url=url, targets=tuple(targets), scrape_job=scrape_job)
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
